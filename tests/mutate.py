"""Mutation testing: plant one small bug at a time in a package and run its fast tests.

Usage, from the repository root (the test extras installed)::

    python tests/mutate.py                          # gsgd_core, 2 workers
    python tests/mutate.py --package backends --jobs 2
    python tests/mutate.py --list                   # the mutants only, no test runs
    python tests/mutate.py --only 12 40 41          # rerun some mutants by number
    python tests/mutate.py --package backends --files plan.py torch.py   # some modules
    python tests/mutate.py --package backends --compiled --only 240   # with torch.compile
    python tests/mutate.py --package adapters --files torch/optim.py   # the torch adapter

Each mutant changes one operator or constant of one module, found with :mod:`ast` and
spliced into the original text (so line numbers and formatting stay): ``+ <-> -``,
``* <-> /``, ``** -> *``, comparisons (``< <-> <=``, ``> <-> >=``, ``== <-> !=``,
``is <-> is not``, ``in <-> not in``), ``and <-> or``, a dropped ``not`` or unary minus,
``True <-> False``, and numbers (``0 <-> 1``, ``x -> x + 1``). Docstrings, strings and the
arguments of ``raise`` (error messages) are left alone. The mutated copy of the package is
put first on ``sys.path`` of a ``pytest -x`` over the package's tests on NumPy (the
namespace every core test runs on); a failing or timed-out run kills the mutant.
Survivors are printed with their line and written, with every result, to ``--out``.

Each of the ``--jobs`` workers is a process that imports pytest, NumPy, torch and
Hypothesis once (never the package under test) and forks a child per mutant, so a mutant
costs its tests alone, not a new interpreter and its imports; Hypothesis runs the "ci"
profile's examples without shrinking a failing one (profile "mutate").
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures as cf
import io
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tokenize
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# package -> (import name, test files, -k expression). NumPy only: the other namespaces run
# the same properties, and a mutant that only they would catch is reported as a survivor.
TARGETS = {
    # Fast tests that see most of the package first: with -x a killed mutant stops early.
    "gsgd_core": ("gsgd_core", [
        "tests/test_errors.py", "tests/test_step.py", "tests/test_chain.py",
        "tests/test_icr.py", "tests/test_path_space.py", "tests/test_reference.py",
        "tests/test_invariance.py", "tests/test_numerics.py", "tests/test_psi_pathsgd.py",
        "tests/test_namespaces.py", "tests/test_defaults.py"],
        "not jax and not strict and not torch and not cupy"),
    "backends": ("gsgd_backends", [
        "tests/test_fast_paths.py", "tests/test_rule_fast_path.py", "tests/test_step_plan.py",
        "tests/test_inplace.py", "tests/test_psi_fast.py", "tests/test_sharded.py",
        "tests/test_namespaces.py", "tests/test_numerics.py", "tests/test_psi_pathsgd.py"],
        "not jax and not strict and not cupy and not compile"),
    # The torch adapter (its modules are torch/*.py: --files torch/optim.py ...); optax's
    # and CuPy's adapters have their own tests (JAX, a GPU) and are left to them.
    "adapters": ("gsgd_adapters", [
        "tests/test_torch_adapter.py", "tests/test_conventions.py", "tests/test_torch_adam.py",
        "tests/test_catalogue.py", "tests/test_step_plan.py", "tests/test_errors.py",
        "tests/test_recipe.py", "tests/test_fsdp.py", "tests/test_torch_ddp.py"],
        "not cupy and not compile"),
}

BINOPS = {ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.Mult: ("*", "/"),
          ast.Div: ("/", "*"), ast.Pow: ("**", "*"), ast.FloorDiv: ("//", "/")}
CMPOPS = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="),
          ast.GtE: (">=", ">"), ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="),
          ast.Is: ("is", "is not"), ast.IsNot: ("is not", "is"),
          ast.In: ("in", "not in"), ast.NotIn: ("not in", "in")}


@dataclass
class Mutant:
    id: int
    file: str
    line: int
    what: str
    start: int   # character offsets into the file's text
    end: int
    new: str
    status: str = "pending"
    seconds: float = 0.0


def _offsets(text: str) -> list[int]:
    starts, pos = [0], 0
    for line in text.splitlines(keepends=True):
        pos += len(line)
        starts.append(pos)
    return starts


def _skipped_nodes(tree: ast.AST) -> set[int]:
    """ids of nodes never mutated: docstrings, raise statements, ``__all__``."""
    skip = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            skip.update(id(n) for n in ast.walk(body[0]))
        if isinstance(node, ast.Raise) or (
                isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)):
            skip.update(id(n) for n in ast.walk(node))
        if isinstance(node, ast.JoinedStr):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def _operator_span(tokens, starts, left, right, token):
    """Offsets of ``token`` (``is not``: its first word) between ``left`` and ``right``."""
    a = starts[left.end_lineno - 1] + left.end_col_offset
    b = starts[right.lineno - 1] + right.col_offset
    first = token.split()[0]
    for t in tokens:
        s = starts[t.start[0] - 1] + t.start[1]
        if a <= s < b and t.string == first:
            if " " in token:  # two words: through the end of the second
                nxt = tokens[tokens.index(t) + 1]
                return s, starts[nxt.end[0] - 1] + nxt.end[1]
            return s, s + len(t.string)
    return None


def find_mutants(path: Path, rel: str, first_id: int) -> list[Mutant]:
    text = path.read_text()
    starts = _offsets(text)
    tree = ast.parse(text)
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(text).readline)
              if t.type in (tokenize.OP, tokenize.NAME)]
    skip = _skipped_nodes(tree)
    out: list[Mutant] = []

    def add(node, what, a, b, new):
        out.append(Mutant(first_id + len(out), rel, node.lineno, what, a, b, new))

    def span(node):
        return (starts[node.lineno - 1] + node.col_offset,
                starts[node.end_lineno - 1] + node.end_col_offset)

    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.BinOp) and type(node.op) in BINOPS:
            old, new = BINOPS[type(node.op)]
            sp = _operator_span(tokens, starts, node.left, node.right, old)
            if sp:
                add(node, f"{old} -> {new}", *sp, new)
        elif isinstance(node, ast.AugAssign) and type(node.op) in BINOPS:
            old, new = BINOPS[type(node.op)]
            sp = _operator_span(tokens, starts, node.target, node.value, old + "=")
            if sp:
                add(node, f"{old}= -> {new}=", *sp, new + "=")
        elif isinstance(node, ast.Compare) and len(node.ops) == 1:
            op = node.ops[0]
            if type(op) in CMPOPS:
                old, new = CMPOPS[type(op)]
                sp = _operator_span(tokens, starts, node.left, node.comparators[0], old)
                if sp:
                    add(node, f"{old} -> {new}", *sp, new)
        elif isinstance(node, ast.BoolOp) and len(node.values) == 2:
            old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            sp = _operator_span(tokens, starts, node.values[0], node.values[1], old)
            if sp:
                add(node, f"{old} -> {new}", *sp, new)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
            a, b = span(node)
            ia, ib = span(node.operand)
            add(node, "drop not" if isinstance(node.op, ast.Not) else "drop unary -",
                a, b, "(" + text[ia:ib] + ")")
        elif isinstance(node, ast.Constant) and type(node.value) in (bool, int, float):
            a, b = span(node)
            v = node.value
            if isinstance(v, bool):
                new = str(not v)
            elif v == 0:
                new = "1" if isinstance(v, int) else "1.0"
            elif v == 1 and isinstance(v, int):
                new = "0"
            else:
                new = repr(v + 1)
            add(node, f"{text[a:b]} -> {new}", a, b, new)
    return out


def apply(text: str, m: Mutant) -> str:
    return text[:m.start] + m.new + text[m.end:]


def _pytest_args(tests, kexpr) -> list[str]:
    return ["-x", "-q", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml"),
            "--rootdir", str(ROOT), "-W", "ignore::DeprecationWarning", "-k", kexpr,
            *[str(ROOT / t) for t in tests]]


def serve(tests, kexpr) -> None:
    """A worker (``--serve``): reads ``<folder> <timeout>`` lines, runs the tests in a forked
    child with ``<folder>`` first on ``sys.path``, and answers ``<status> <seconds>``."""
    import numpy  # noqa: F401  (the heavy imports, once: every child shares them)
    import pytest
    import hypothesis  # noqa: F401
    import torch
    torch.set_num_threads(1)
    out = sys.stdout
    for line in sys.stdin:
        folder, timeout = line.rsplit(" ", 1)
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:  # the child: quiet, in the copy, the mutated package first
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            os.chdir(folder)
            sys.path.insert(0, folder)
            sys.path.append(str(ROOT))  # the repository's benchmarks, which tests import
            os._exit(int(pytest.main(_pytest_args(tests, kexpr))))
        status = None
        while status is None:
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                status = "survived" if os.waitstatus_to_exitcode(code) == 0 else "killed"
            elif time.perf_counter() - t0 > float(timeout):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                status = "killed (timeout)"
            else:
                time.sleep(0.05)
        out.write(f"{status} {time.perf_counter() - t0:.2f}\n")
        out.flush()


class Worker:
    """One ``--serve`` process of this script for a package's tests."""

    def __init__(self, package: str, compiled: bool = False) -> None:
        env = dict(os.environ, HYPOTHESIS_PROFILE="mutate", PYTHONDONTWRITEBYTECODE="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve", "--package", package]
            + (["--compiled"] if compiled else []),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)

    def run(self, folder: Path, timeout: float) -> tuple[str, float]:
        self.proc.stdin.write(f"{folder} {timeout}\n")
        self.proc.stdin.flush()
        status, seconds = self.proc.stdout.readline().rsplit(" ", 1)
        return status, float(seconds)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def check_isolation(pkg_dir: Path, name: str) -> None:
    """The tests must import the copy, not the installed package."""
    env = dict(os.environ, PYTHONPATH=str(pkg_dir))
    where = subprocess.run([sys.executable, "-c", f"import {name}; print({name}.__file__)"],
                           cwd=pkg_dir, env=env, capture_output=True, text=True,
                           check=True).stdout
    if not where.strip().startswith(str(pkg_dir)):
        sys.exit(f"{name} imports from {where.strip()}, not from the mutated copy {pkg_dir}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--package", choices=sorted(TARGETS), default="gsgd_core")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", type=int, nargs="*", help="mutant numbers to run")
    ap.add_argument("--files", nargs="*", help="only the mutants of these modules (plan.py ...)")
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    ap.add_argument("--out", default=None, help="JSON results (default mutation-<pkg>.json)")
    ap.add_argument("--compiled", action="store_true",
                    help="backends: run the torch.compile tests too (minutes per mutant)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    name, tests, kexpr = TARGETS[args.package]
    if args.compiled:
        kexpr = kexpr.replace(" and not compile", "")
    if args.serve:
        serve(tests, kexpr)
        return 0
    src = ROOT / args.package
    mutants: list[Mutant] = []
    for path in sorted(src.rglob("*.py")):
        mutants += find_mutants(path, str(path.relative_to(src)), len(mutants))
    if args.list:
        for m in mutants:
            print(f"{m.id:4d} {m.file}:{m.line} {m.what}")
        return 0
    todo = [m for m in mutants if (args.only is None or m.id in args.only)
            and (args.files is None or m.file in args.files)]

    work = Path(tempfile.mkdtemp(prefix="gsgd-mutate-"))
    base = work / "base" / name
    shutil.copytree(src, base, ignore=shutil.ignore_patterns("__pycache__"))
    check_isolation(base.parent, name)
    workers: queue.Queue = queue.Queue()
    for _ in range(args.jobs):
        workers.put(Worker(args.package, args.compiled))
    first = workers.get()
    status, baseline = first.run(base.parent, timeout=1800)
    workers.put(first)
    if status != "survived":
        sys.exit(f"the tests fail without any mutant ({status}): fix them first")
    timeout = 3 * baseline + 30
    print(f"{len(todo)} mutants of {args.package}; unmutated tests take {baseline:.0f} s",
          flush=True)

    def one(m: Mutant) -> Mutant:
        d = work / f"m{m.id}"
        shutil.copytree(base, d / name)
        f = d / name / m.file
        f.write_text(apply(f.read_text(), m))
        try:
            compile(f.read_text(), str(f), "exec")
        except SyntaxError:
            m.status = "invalid"
            return m
        worker = workers.get()
        try:
            m.status, m.seconds = worker.run(d, timeout)
        finally:
            workers.put(worker)
        shutil.rmtree(d, ignore_errors=True)
        return m

    done = 0
    with cf.ThreadPoolExecutor(args.jobs) as pool:
        for m in pool.map(one, todo):
            done += 1
            if m.status == "survived":
                print(f"[{done}/{len(todo)}] SURVIVED #{m.id} {m.file}:{m.line} {m.what}",
                      flush=True)
            elif done % 20 == 0:
                print(f"[{done}/{len(todo)}]", flush=True)
    while not workers.empty():
        workers.get().close()
    shutil.rmtree(work, ignore_errors=True)

    valid = [m for m in todo if m.status != "invalid"]
    killed = [m for m in valid if m.status.startswith("killed")]
    rate = len(killed) / max(len(valid), 1)
    print(f"\n{args.package}: {len(killed)}/{len(valid)} mutants killed ({rate:.1%}); "
          f"{len(todo) - len(valid)} invalid")
    for m in valid:
        if m.status == "survived":
            print(f"  survived #{m.id} {m.file}:{m.line} {m.what}")
    out = args.out or f"mutation-{args.package}.json"
    Path(out).write_text(json.dumps([asdict(m) for m in todo], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
