"""The main job runs end to end (quick budget), writes its summary and plots, and its
unbalanced-start experiment shows G-SGD's curves unchanged by rescaling."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (ROOT / "benchmarks").is_dir(), reason="benchmarks/ not in checkout")
def test_quick_unbalanced_experiment(tmp_path):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--only",
                           "unbalanced", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = (tmp_path / "summary.md").read_text()
    assert (tmp_path / "unbalanced.png").stat().st_size > 10_000
    gap = float(re.search(r"over all spreads and seeds: ([0-9.e+-]+)\.", summary).group(1))
    assert gap < 1e-9
    assert "| 2 | SGD |" in summary and "| 2 | G-SGD |" in summary


@pytest.mark.skipif(not (ROOT / "benchmarks").is_dir(), reason="benchmarks/ not in checkout")
def test_quick_adam_experiment_shows_g_adam_unchanged_by_rescaling(tmp_path):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--only", "adam",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "SkeletonWarning" not in proc.stderr
    summary = (tmp_path / "summary.md").read_text()
    assert (tmp_path / "adam_unbalanced.png").stat().st_size > 10_000
    gap = float(re.search(r"over all spreads and seeds: ([0-9.e+-]+)\.", summary).group(1))
    assert gap < 1e-9
    for row in ("| Adam, He init |", "| G-Adam, skeleton init |", "| 2 | Adam, skeleton init |",
                "| 2 | G-Adam, skeleton init |"):
        assert row in summary


def test_help_lists_the_experiments():
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    for name in ("ratio", "unbalanced", "pathsgd", "bn", "momentum", "adam", "--quick",
                 "--out"):
        assert name in proc.stdout


@pytest.mark.skipif(not (ROOT / "benchmarks").is_dir(), reason="benchmarks/ not in checkout")
def test_jax_digits_example_trains_next_to_optax_sgd():
    pytest.importorskip("optax")
    pytest.importorskip("sklearn")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.jax_digits", "--epochs", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 2 and all(len(r) == 3 for r in rows)
    assert float(rows[1][2]) < float(rows[0][2])  # G-SGD's loss goes down


@pytest.mark.skipif(not (ROOT / "benchmarks").is_dir(), reason="benchmarks/ not in checkout")
def test_cupy_digits_loop_trains_with_numpy_arrays():
    """The hand-written loop of the CuPy example, here on NumPy (CuPy needs a GPU)."""
    pytest.importorskip("sklearn")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.cupy_digits", "--backend", "numpy",
                           "--epochs", "3"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 3 and float(rows[2][2]) < float(rows[0][2])


@pytest.mark.skipif(not (ROOT / "benchmarks").is_dir(), reason="benchmarks/ not in checkout")
def test_step_overhead_quick_writes_its_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.step_overhead", "--quick",
                           "--no-compile", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = (tmp_path / "step_overhead.md").read_text()
    assert "| torch cpu | MLP 64-64-64-10 |" in table and "| numpy | CNN c=32 |" in table
    assert "train step, batch 128" in table
    assert (tmp_path / "step_overhead.png").stat().st_size > 10_000


@pytest.mark.skipif(not (ROOT / "benchmarks").is_dir(), reason="benchmarks/ not in checkout")
def test_fsdp_benchmark_counts_what_each_step_sends(tmp_path):
    """Two FSDP2 processes: G-SGD's step sends one small vector (the sum of the chain's
    widths and skeleton edges, a few KiB), SGD's sends nothing, and a training step moves
    the weights themselves (far more)."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.fsdp", "--quick", "--reps", "1",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {}
    for line in (tmp_path / "fsdp.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 9 and cells[0] == "MLP 64-256-256-10":
            rows[cells[2]] = cells

    def kib(cell):
        value, unit = cell.split()
        return float(value) * (1024 if unit == "MiB" else 1)

    assert kib(rows["SGD"][7]) == 0 and kib(rows["Adam"][7]) == 0
    # 64-256-256-10: column sums 256+256, skeleton edges, biases 256+256+10, 4 bytes each
    assert 4 < kib(rows["G-SGD"][7]) < 40
    assert kib(rows["G-SGD"][8]) > 20 * kib(rows["G-SGD"][7])
