"""The Keras adapter on the JAX and torch backends of Keras: each backend's tests
(tests/_keras_cases.py) run in a process of their own, since Keras reads ``KERAS_BACKEND``
once, when it is first imported."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

# Looked up, not imported: only the processes the tests start import Keras (seconds each).
if importlib.util.find_spec("keras") is None:
    pytest.skip("keras is not installed", allow_module_level=True)
HERE = pathlib.Path(__file__).parent


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_keras_backend(backend):
    pytest.importorskip(backend)
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, pytest; sys.exit(pytest.main(sys.argv[1:]))",
         "-n", "0", "-q", "-p", "no:cacheprovider", str(HERE / "_keras_cases.py")],
        cwd=HERE.parent, env={**os.environ, "KERAS_BACKEND": backend},
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


@pytest.mark.skipif(not (HERE.parent / "benchmarks").is_dir(), reason="benchmarks/ not in checkout")
def test_keras_mnist_benchmark_trains_next_to_keras_sgd(tmp_path):
    for module in ("jax", "sklearn", "mlxtend", "matplotlib"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.keras_mnist", "--epochs", "2",
                           "--train", "128", "--out", str(tmp_path)], cwd=HERE.parent,
                          env={**os.environ, "KERAS_BACKEND": "jax"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 2 and all(len(r) == 4 for r in rows)
    assert float(rows[1][3]) < float(rows[0][3])  # G-SGD's loss goes down
    assert "G-SGD: " in proc.stdout and (tmp_path / "keras_mnist.png").is_file()
