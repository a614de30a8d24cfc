"""The mutation-testing script (tests/mutate.py) plants what it says it plants."""

import ast
from pathlib import Path

import mutate

ROOT = Path(__file__).resolve().parent.parent


def test_every_mutant_compiles_and_changes_exactly_one_operator_or_constant():
    files = sorted((ROOT / "gsgd_core").glob("*.py"))
    mutants = []
    for path in files:
        mutants += mutate.find_mutants(path, path.name, len(mutants))
    assert len(mutants) > 500 and len({m.id for m in mutants}) == len(mutants)
    kinds = {m.what.split(" -> ")[0] for m in mutants}
    assert {"+", "-", "*", "/", "<", "==", "and", "or", "True", "is"} <= kinds
    for m in mutants:
        text = (ROOT / "gsgd_core" / m.file).read_text()
        new = mutate.apply(text, m)
        assert new != text and len(new) - len(text) == len(m.new) - (m.end - m.start)
        ast.parse(new)  # still Python


def test_docstrings_messages_and_all_are_left_alone(tmp_path):
    src = '''"""Doc 1 + 2."""
__all__ = ["a" + "b"]


def f(x):
    """x + 1"""
    if x < 0:
        raise ValueError(f"x must be >= {0 + 1}")
    return x + 1
'''
    path = tmp_path / "sample.py"
    path.write_text(src)
    mutants = mutate.find_mutants(path, path.name, 0)
    assert sorted(m.what for m in mutants) == sorted(["< -> <=", "0 -> 1", "+ -> -", "1 -> 0"])
    assert {m.line for m in mutants} == {7, 9}
