"""Packaging and layering: the tests run against the installed package, the core imports no
framework, and every package carries its version and type marker."""

import ast
import os
import pathlib

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
