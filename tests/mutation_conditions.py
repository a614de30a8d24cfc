"""The condition-level mutants: what mutmut's operators never make, for its second pass.

mutmut's operators change operators, numbers, strings and names; they never drop a
condition, an operand of ``and``/``or``, a guard or a term, the most common real bugs.
These operators make those, one at a time, and mutmut runs them as it runs its own (one
copy behind trampolines, the tests that reach each function, a warm fork server):

- the condition of an ``if``/``elif``/``while``/``assert``, a conditional expression or a
  comprehension's filter replaced by ``True`` and by ``False`` (a guard's ``False`` is
  written as the guard deleted: an ``if`` whose body only raises, returns, continues,
  breaks or warns, replaced by ``pass``);
- each operand of an ``and``/``or`` dropped, and each ``not``;
- ``x - y``, ``x + y``, ``x * y`` and ``x / y`` replaced by ``x`` and by ``y``;
- each keyword argument of a call dropped;
- ``return EXPR`` inside a branch replaced by ``return None`` where its function has
  another ``return``;
- each default value of a public function's parameter replaced by its type's zero.

``python tests/mutation_conditions.py ARGS`` is ``mutmut ARGS`` with these operators in
place of mutmut's (``tests/mutation.py --pass conditions`` runs it).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator

import libcst as cst
from libcst.metadata import MetadataWrapper

#: The statements a guard's body holds, and nothing else (a warning is a call of ``warn``).
EXITS = (cst.Raise, cst.Return, cst.Continue, cst.Break)
#: The compound statements whose bodies are branches of their function.
BRANCHES = (cst.If, cst.Else, cst.For, cst.While, cst.Try, cst.ExceptHandler, cst.Match)
TERMS = (cst.Add, cst.Subtract, cst.Multiply, cst.Divide)
SCOPES = (cst.FunctionDef, cst.ClassDef, cst.Lambda)


def _same_parens(old: cst.BaseExpression, new: cst.BaseExpression) -> cst.BaseExpression:
    """``new`` in ``old``'s place, inside ``old``'s parentheses as well as its own."""
    return new.with_changes(lpar=[*old.lpar, *new.lpar], rpar=[*new.rpar, *old.rpar])


def _literals(test: cst.BaseExpression) -> Iterator[cst.Name]:
    """``True`` and ``False`` for a condition, less the one it already is."""
    for value in ("True", "False"):
        if not (isinstance(test, cst.Name) and test.value == value):
            yield _same_parens(test, cst.Name(value))


def _is_warning(small: cst.BaseSmallStatement) -> bool:
    """``warn(...)`` or ``warnings.warn(...)`` as a statement."""
    call = small.value if isinstance(small, cst.Expr) else None
    func = call.func if isinstance(call, cst.Call) else None
    return (isinstance(func, cst.Name) and func.value == "warn") or (
        isinstance(func, cst.Attribute) and func.attr.value == "warn")


def is_guard(node: cst.If) -> bool:
    """An ``if`` without ``elif``/``else`` whose body only raises, returns, continues,
    breaks or warns."""
    if node.orelse is not None:
        return False
    if isinstance(node.body, cst.SimpleStatementSuite):  # `if x: raise ...` on one line
        small = list(node.body.body)
    elif all(isinstance(line, cst.SimpleStatementLine) for line in node.body.body):
        small = [s for line in node.body.body for s in line.body]
    else:
        return False
    return all(isinstance(s, EXITS) or _is_warning(s) for s in small)


def _zero(default: cst.BaseExpression) -> cst.BaseExpression | None:
    """The zero of a default value's type (``0``, ``0.0``, ``False``, ``""``); None where it
    is one already or its type is not known from the source."""
    if isinstance(default, cst.Integer) and default.evaluated_value != 0:
        return cst.Integer("0")
    if isinstance(default, cst.Float) and default.evaluated_value != 0.0:
        return cst.Float("0.0")
    if isinstance(default, cst.Name) and default.value == "True":
        return cst.Name("False")
    if isinstance(default, cst.SimpleString) and default.evaluated_value:
        return cst.SimpleString('""')
    return None


def _public(name: str) -> bool:
    return not name.startswith("_") or (name.startswith("__") and name.endswith("__"))


class Context(cst.CSTVisitor):
    """What an operator cannot see from its node alone, found in one pass over the module:
    which ``if`` is an ``elif``, which ``return`` is in a branch of a function that has
    another, and which parameters are a public function's."""

    def __init__(self, module: cst.Module):
        super().__init__()
        self.elifs: set[int] = set()
        self.branch_returns: set[int] = set()
        self.public_params: set[int] = set()
        self._held: list[cst.CSTNode] = []  # the nodes named by id, kept alive
        self._scopes: list[cst.CSTNode] = []
        module.visit(self)

    def _note(self, ids: set[int], node: cst.CSTNode) -> None:
        ids.add(id(node))
        self._held.append(node)

    def visit_If(self, node: cst.If) -> None:
        if isinstance(node.orelse, cst.If):
            self._note(self.elifs, node.orelse)

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._scopes.append(node)

    def leave_ClassDef(self, node: cst.ClassDef) -> None:
        self._scopes.pop()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        returns = list(_returns(node.body, in_branch=False))
        if len(returns) > 1:
            for ret, in_branch in returns:
                if in_branch and ret.value is not None and not (
                        isinstance(ret.value, cst.Name) and ret.value.value == "None"):
                    self._note(self.branch_returns, ret)
        scopes = [*self._scopes, node]
        if all(isinstance(s, cst.ClassDef) for s in self._scopes) and all(
                _public(s.name.value) for s in scopes):
            p = node.params
            for param in (*p.posonly_params, *p.params, *p.kwonly_params):
                self._note(self.public_params, param)
        self._scopes.append(node)

    def leave_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._scopes.pop()


def _returns(node: cst.CSTNode, in_branch: bool) -> Iterator[tuple[cst.Return, bool]]:
    """The ``return`` statements of a function's body (not of the functions it defines),
    each with whether it lies in a branch."""
    for child in node.children:
        if isinstance(child, cst.Return):
            yield child, in_branch
        elif not isinstance(child, SCOPES):
            yield from _returns(child, in_branch or isinstance(child, BRANCHES))


def operators(ctx: Context) -> list[tuple[type, Callable[[cst.CSTNode], Iterable[cst.CSTNode]]]]:
    """The operators as mutmut takes them: ``(node type, node -> its mutants)``."""

    def if_(node: cst.If) -> Iterator[cst.CSTNode]:
        for literal in _literals(node.test):
            if literal.value == "False" and id(node) not in ctx.elifs and is_guard(node):
                yield cst.SimpleStatementLine([cst.Pass()])  # the guard deleted
            else:
                yield node.with_changes(test=literal)

    def condition(node):
        for literal in _literals(node.test):
            yield node.with_changes(test=literal)

    def operand_dropped(node: cst.BooleanOperation) -> Iterator[cst.BaseExpression]:
        # `a and b and c` is `(a and b) and c`: the outer node drops `c`, the inner `a`, `b`
        chained = isinstance(node.left, cst.BooleanOperation) and not node.left.lpar and (
            type(node.left.operator) is type(node.operator))
        yield _same_parens(node, node.left)
        if not (chained or node.left.deep_equals(node.right)):  # `x - x` makes one mutant
            yield _same_parens(node, node.right)

    def not_dropped(node: cst.UnaryOperation) -> Iterator[cst.BaseExpression]:
        if isinstance(node.operator, cst.Not):
            yield _same_parens(node, node.expression)

    def term_dropped(node: cst.BinaryOperation) -> Iterator[cst.BaseExpression]:
        if isinstance(node.operator, TERMS):
            yield _same_parens(node, node.left)
            if not node.left.deep_equals(node.right):
                yield _same_parens(node, node.right)

    def keyword_dropped(node: cst.Call) -> Iterator[cst.Call]:
        for i, arg in enumerate(node.args):
            if arg.keyword is not None:
                yield node.with_changes(args=[*node.args[:i], *node.args[i + 1:]])

    def return_none(node: cst.Return) -> Iterator[cst.Return]:
        if id(node) in ctx.branch_returns:
            yield node.with_changes(value=cst.Name("None"))

    def default_zero(node: cst.Param) -> Iterator[cst.Param]:
        zero = _zero(node.default) if node.default is not None else None
        if zero is not None and id(node) in ctx.public_params:
            yield node.with_changes(default=zero)

    return [(cst.If, if_), (cst.While, condition), (cst.Assert, condition),
            (cst.IfExp, condition), (cst.CompIf, condition),
            (cst.BooleanOperation, operand_dropped), (cst.UnaryOperation, not_dropped),
            (cst.BinaryOperation, term_dropped), (cst.Call, keyword_dropped),
            (cst.Return, return_none), (cst.Param, default_zero)]


def create_mutations(filename: str, code: str, covered_lines: set[int] | None = None,
                     coverage_excluded_lines: set[int] | None = None) -> tuple:
    """mutmut's ``create_mutations`` with these operators in place of its own: the module,
    its mutations, and the classes and functions its pragmas leave alone."""
    from mutmut.mutation.pragma_handling import get_ignored_lines

    wrapper = MetadataWrapper(cst.parse_module(code))
    ignored = get_ignored_lines(filename, code, wrapper, coverage_excluded_lines)
    return _mutations(wrapper, ignored, covered_lines)


def _mutations(wrapper: MetadataWrapper, ignored, covered_lines: set[int] | None) -> tuple:
    """mutmut's visitor over the module with these operators, each given its context."""
    from mutmut.mutation.file_mutation import MutationVisitor

    visitor = MutationVisitor(operators(Context(wrapper.module)), ignored, covered_lines)
    module = wrapper.visit(visitor)
    return module, visitor.mutations, visitor.ignored_classes, visitor.ignored_functions


def mutants(code: str) -> list[tuple[str, str]]:
    """Each mutant of ``code`` (no pragmas read): the source of the top-level function it
    changes, and of its mutant."""
    from mutmut.mutation.file_mutation import deep_replace
    from mutmut.mutation.pragma_handling import IgnoredCode

    module, found, _, _ = _mutations(MetadataWrapper(cst.parse_module(code)),
                                     IgnoredCode(set(), set(), set()), None)
    return [(module.code_for_node(f), module.code_for_node(deep_replace(
        f, m.original_node, m.mutated_node))) for m in found
        if (f := m.contained_by_top_level_function) is not None]


def main(argv: list[str]) -> None:
    """``mutmut ARGV`` with these operators."""
    from mutmut import __main__ as cli
    from mutmut.mutation import file_mutation

    file_mutation.create_mutations = create_mutations
    sys.argv = ["mutmut", *argv]
    cli.cli()


if __name__ == "__main__":
    main(sys.argv[1:])
