"""Packaging and layering: the tests run against the installed package, the core imports no
framework, and every package carries its version and type marker."""

import ast
import os
import pathlib
import subprocess
import sys

import pytest

import gsgd_adapters
import gsgd_backends
import gsgd_core

FRAMEWORKS = {"torch", "jax", "jaxlib", "cupy", "cupyx", "tensorflow", "optax"}


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]


def test_core_imports_no_framework_even_lazily():
    root = pathlib.Path(gsgd_core.__file__).parent
    for path in root.rglob("*.py"):
        bad = FRAMEWORKS.intersection(_imports(path))
        assert not bad, f"{path.name} imports {bad}"


def test_layering_points_one_way():
    for pkg, forbidden in ((gsgd_core, {"gsgd_backends", "gsgd_adapters"}),
                           (gsgd_backends, {"gsgd_adapters"})):
        for path in pathlib.Path(pkg.__file__).parent.rglob("*.py"):
            assert not forbidden.intersection(_imports(path)), path


def _private_imports(path: pathlib.Path):
    """Names with one leading underscore that ``path`` imports from another module."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            yield from (a.name for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__"))


def test_no_module_imports_another_modules_private_names():
    for pkg in (gsgd_core, gsgd_backends, gsgd_adapters):
        for path in pathlib.Path(pkg.__file__).parent.rglob("*.py"):
            private = list(_private_imports(path))
            assert not private, (path, private)


def test_packages_carry_version_and_type_marker():
    assert gsgd_core.__version__
    for pkg in (gsgd_core, gsgd_backends, gsgd_adapters):
        assert (pathlib.Path(pkg.__file__).parent / "py.typed").exists(), pkg.__name__


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="only CI installs non-editable")
def test_ci_tests_the_installed_package_not_the_checkout():
    repo = pathlib.Path(__file__).resolve().parents[1]
    for pkg in (gsgd_core, gsgd_backends, gsgd_adapters):
        assert repo not in pathlib.Path(pkg.__file__).resolve().parents, pkg.__file__


WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None  # `import torch` raises ImportError, as where it is not installed
import numpy as np
import gsgd_core as gc
import gsgd_adapters.cupy
from gsgd_backends import gsgd_update_, psi_update_
chain = gc.Chain.mlp([4, 3, 2])
rng = np.random.default_rng(0)
W = [rng.standard_normal(s) for s in ((3, 4), (2, 3))]
G = [rng.standard_normal(w.shape) for w in W]
b, Gb = [rng.standard_normal(n) for n in (3, 2)], [rng.standard_normal(n) for n in (3, 2)]
want, want_b, _ = gc.gsgd_update(chain, gc.gsgd_init(chain, W, b), W, b, G, Gb, lr=0.1)
gsgd_update_(chain, None, W, b, G, Gb, lr=0.1)
assert all(np.allclose(x, y, rtol=1e-12) for x, y in zip(W + b, want + want_b))
want, _ = gc.psi_update(gc.psi_init(W), W, G, lr=0.1)
psi_update_(gc.psi_init(W), W, G, lr=0.1)
assert all(np.allclose(a, b, rtol=1e-12) for a, b in zip(W, want))
assert "torch" not in {m.split(".")[0] for m, v in sys.modules.items() if v is not None}
print("ok")
"""


def test_numpy_users_need_no_torch():
    """torch is an optional extra: without it the backends' NumPy fast paths and the CuPy
    adapter import and step (``gsgd_backends`` imported torch for its PSI step once)."""
    done = subprocess.run([sys.executable, "-c", WITHOUT_TORCH], capture_output=True,
                          text=True, timeout=120, cwd=pathlib.Path(gsgd_core.__file__).parents[1])
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
