"""The Keras adapter on the JAX and torch backends of Keras: each backend's tests
(tests/_keras_cases.py) run in a process of their own, since Keras reads ``KERAS_BACKEND``
once, when it is first imported."""

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("keras")
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
