"""Mutation testing with mutmut, one module at a time, with the tests that cover it.

Usage, from the repository root (``pip install -e .[test,torch,jax,jax-test,mutation]``)::

    python tests/mutation.py backends/plan.py              # one module
    python tests/mutation.py backends/plan.py adapters/optax.py --jobs 2
    python tests/mutation.py --all                         # every module of the table
    python tests/mutation.py backends/plan.py --again      # its survivors, with new tests
    python tests/mutation.py adapters/jax/units.py --again --tests tests/test_jax_discovery.py
    python tests/mutation.py backends/inplace.py --functions _finite  # one function's mutants
    python tests/mutation.py gsgd_core/chain.py --pass conditions  # the second pass
    python tests/mutation.py --report                      # docs/mutation.md from results/

mutmut names a mutant by its file's path (``backends/plan.py`` gives ``backends.plan.*``)
and looks for it under the name the tests import (``gsgd_backends.plan``), and it mutates
a copy of the sources that the tests must import instead of the installed package. Our
packages live in folders named otherwise (``backends/`` is ``gsgd_backends``), so each run
stages a copy laid out under the import names (``build/mutation/<module>/``), writes
``[tool.mutmut]`` of ``pyproject.toml`` there with the module and its tests
(``[tool.gsgd.mutation]``), and runs ``mutmut run`` in it. Hypothesis runs its ``mutate``
profile (``ci`` without shrinking). Results (every mutant's status, survivors with their
diff, the run's duration) go to ``tests/mutation-results/<module>.json``, kept with the
sources; ``--report`` turns them into ``docs/mutation.md`` together with the reasons given
in ``[tool.gsgd.mutation]``. A result whose per-mutant statuses were not kept holds their
``counts`` instead (``{"killed": 150, "survived": 1}``).

``--pass conditions`` makes the second pass: mutmut with the condition-level operators of
``tests/mutation_conditions.py`` (a condition made ``True`` or ``False``, a guard deleted,
an operand or a term dropped...), its copies in ``build/mutation/conditions/``, its results
in ``tests/mutation-results/conditions/``, its equivalents in
``[tool.gsgd.mutation.conditions.equivalent]``; ``--again``, ``--tests``, ``--functions``
and ``--stopped`` work on it as on the first.
"""

from __future__ import annotations

import argparse
import collections
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Folders as the repository holds them -> the package names the tests import.
PACKAGES = {"gsgd_core": "gsgd_core", "backends": "gsgd_backends", "adapters": "gsgd_adapters"}
BUILD, RESULTS = ROOT / "build" / "mutation", ROOT / "tests" / "mutation-results"
MUTMUT = Path(sys.executable).with_name("mutmut")  # beside this interpreter
#: The passes, each mutmut with its operators: its own, and the condition-level ones
#: (tests/mutation_conditions.py), whose runs and results have folders of their own.
PASSES = {"mutmut": [str(MUTMUT)],
          "conditions": [sys.executable, str(ROOT / "tests" / "mutation_conditions.py")]}
PASS = "mutmut"  # the pass this run makes (``--pass``)


def _folder(kind: str | None = None) -> str:
    """The subfolder of a pass's runs and results: none for mutmut's own."""
    kind = kind or PASS
    return "" if kind == "mutmut" else kind


def equivalent(conf: dict, kind: str | None = None) -> dict[str, str]:
    """A pass's equivalent mutants and why: ``[tool.gsgd.mutation.equivalent]`` for
    mutmut's, ``[tool.gsgd.mutation.<pass>.equivalent]`` for another's (the passes name
    their mutants alike)."""
    kind = kind or PASS
    return conf.get("equivalent", {}) if kind == "mutmut" else conf.get(kind, {}).get(
        "equivalent", {})


def settings() -> dict:
    """``[tool.gsgd.mutation]``: ``tests`` (module -> test files), ``gpu_only`` (modules
    only a GPU runs), ``fork_unsafe`` (modules, or folders ending in ``/``, whose tests
    cannot run in a child forked after their collection: it is forked after importing
    ``preload`` instead), ``in_workers`` (function -> the
    tests that reach it only in processes they spawn), ``dynamo_off`` (modules whose functions
    torch.compile traces: dynamo cannot trace mutmut's trampolines, so their tests run them
    eagerly), ``env`` (modules, or folders ending in ``/`` -> environment variables of
    their tests), ``equivalent`` (mutant name -> why no test can tell it apart)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        data = tomllib.load(f)
    return data["tool"]["gsgd"]["mutation"] | {"mutmut": data["tool"]["mutmut"]}


def _staged(module: str) -> Path:
    """``module``'s staged copy and mutmut's folder (``build/mutation/backends.plan.py``)."""
    return BUILD / _folder() / module.replace("/", ".")


def _saved(module: str) -> Path:
    """Where ``module``'s result is kept (``tests/mutation-results/backends.plan.py.json``,
    another pass's under its folder there)."""
    return RESULTS / _folder() / (module.replace("/", ".") + ".json")


def _save(result: dict) -> dict:
    _saved(result["module"]).parent.mkdir(parents=True, exist_ok=True)
    _saved(result["module"]).write_text(json.dumps(result, indent=1))
    return result


def import_path(module: str) -> str:
    """``backends/plan.py`` -> ``gsgd_backends/plan.py``: where the staged copy holds it."""
    top, _, rest = module.partition("/")
    return f"{PACKAGES[top]}/{rest}"


# Each mutant's child compiles the JAX tests' functions anew (the adapters' and the core's
# JAX namespace cases): XLA's persistent cache on disk, keyed by the compiled program, lets
# them reuse each other's (six times faster for the adapters, twice for a namespace case).
def jax_cache() -> dict:
    """The environment that points a run's JAX at the shared cache (``build/mutation/``)."""
    return {"JAX_COMPILATION_CACHE_DIR": str(BUILD / "jax-cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def _module_env(module: str, conf: dict) -> dict[str, str]:
    """The variables ``env`` sets for ``module``'s tests."""
    return {k: v for prefix, env in conf.get("env", {}).items() if module.startswith(prefix)
            for k, v in env.items()}


def _fork_unsafe(module: str, conf: dict) -> bool:
    """Whether ``module``'s tests run JAX (``fork_unsafe``)."""
    return any(module.startswith(prefix) for prefix in conf.get("fork_unsafe", []))


def stage(module: str, tests: list[str], conf: dict, keep: bool = False) -> Path:
    """A copy of the packages under their import names, the tests, the benchmarks they
    import and the docs they read, and a ``pyproject.toml`` whose ``[tool.mutmut]`` mutates
    ``module`` alone; ``keep`` keeps mutmut's folder of an earlier run (its mutants and their
    verdicts)."""
    dest = _staged(module)
    for old in (dest.iterdir() if dest.exists() else []):
        if not (keep and old.name == "mutants"):
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    dest.mkdir(parents=True, exist_ok=True)
    for folder, name in PACKAGES.items():
        shutil.copytree(ROOT / folder, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    for folder in ("tests", "benchmarks", "docs"):  # tests of the docs' examples read docs/
        shutil.copytree(ROOT / folder, dest / folder, ignore=shutil.ignore_patterns(
            "__pycache__", ".hypothesis"))
    target = import_path(module)
    mutmut = conf["mutmut"] | {
        "source_paths": [target.split("/")[0] + "/"],
        "only_mutate": [target],
        "also_copy": [name + "/" for name in PACKAGES.values()] + ["tests/", "benchmarks/",
                                                                     "docs/"],
        "pytest_add_cli_args_test_selection": tests,
    }
    if _fork_unsafe(module, conf):
        # the fork server imports the libraries only: no test has run, so no JAX thread
        (dest / "preload.txt").write_text("\n".join(conf["preload"]) + "\n")
        mutmut |= {"forkserver_warmup": "import",
                   "preload_modules_file": str(dest / "preload.txt")}
    lines = ["[tool.mutmut]"] + [f"{k} = {json.dumps(v)}" for k, v in mutmut.items()]
    pytest_conf = ['[tool.pytest.ini_options]', 'addopts = ["-ra"]',
                   'filterwarnings = ["error::RuntimeWarning"]']
    (dest / "pyproject.toml").write_text("\n".join(lines + [""] + pytest_conf) + "\n")
    return dest


#: Exit codes mutmut calls "suspicious" that are a crash of the tests' process: SIGABRT,
#: which the C library raises on a heap a kernel wrote out of bounds.
CRASHES = {-6: "abort"}


def statuses(dest: Path, module: str) -> dict[str, str]:
    """Every mutant of the run in ``dest`` and its status as mutmut names it, or as
    ``CRASHES`` does."""
    from mutmut.stats import status_by_exit_code

    meta = json.loads((dest / "mutants" / (import_path(module) + ".meta")).read_text())
    return {k: CRASHES.get(v) or status_by_exit_code[v]
            for k, v in sorted(meta["exit_code_by_key"].items())}


def hashes(dest: Path, module: str) -> dict[str, str]:
    """mutmut's hash of each function of the run in ``dest`` (none before a first run)."""
    meta = dest / "mutants" / (import_path(module) + ".meta")
    return json.loads(meta.read_text())["hash_by_function_name"] if meta.exists() else {}


SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"  # the frames mutmut's progress lines start with


class MutmutFailed(RuntimeError):
    """``mutmut run`` ended with an error (its output's tail is the message)."""


def mutmut_run(dest: Path, module: str, jobs: int, names: list[str], env: dict) -> None:
    """``mutmut run`` in ``dest``: the mutants without a verdict, or ``names`` again."""
    done = subprocess.run([*PASSES[PASS], "run", "--max-children", str(jobs), *names], cwd=dest,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        # the spinner's frames would fill the tail and hide the tests' output before them
        shown = "\n".join(line for line in done.stdout.replace("\r", "\n").splitlines()
                          if line.strip() and line.lstrip()[0] not in SPINNER)
        raise MutmutFailed(f"mutmut failed on {module}:\n{shown[-6000:]}")


def _env(module: str, conf: dict) -> dict:
    """The environment of ``module``'s mutmut runs. Triton interprets its kernels unless
    ``TRITON_INTERPRET=0`` is given (on a GPU): its library is decided at its first import,
    so a test file importing it for compiled kernels before the fused tests' files would make
    those skip (they set the variable only around their own imports). The scripts some tests
    start (``torch.distributed.run``, a JAX process of four devices) import the staged
    sources, not an installed gsgd: unmutated here (mutmut's trampolines would look for its
    configuration in such a script's folder), mutated in the reruns of ``in_workers``."""
    path = os.pathsep.join(filter(None, [str(_staged(module)), os.environ.get("PYTHONPATH")]))
    return os.environ | {"HYPOTHESIS_PROFILE": "mutate", "PYTHONDONTWRITEBYTECODE": "1",
                         "PYTHONPATH": path,
                         "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")} | (
        {"TORCH_COMPILE_DISABLE": "1"} if module in conf.get("dynamo_off", []) else {}) | (
        jax_cache()) | _module_env(module, conf)


def run(module: str, jobs: int, conf: dict, again: bool = False,
        only: list[str] | None = None) -> dict:
    """mutmut over ``module`` with its tests; the result as written to ``RESULTS``.

    ``again``: keep the verdicts of the last run, run the mutants of the functions changed
    since (mutmut regenerates those), then run that run's survivors (and those no test
    reached) with today's tests. mutmut's record of which tests reach which function is
    rebuilt first: it traces only tests new by name, so a test changed to reach a function
    would not be run on that function's survivors. A run stopped before its end has no
    result yet: ``again`` then runs the mutants it left without a verdict (the result says
    "resumed") with the record it had.

    ``only``: with ``again``, the survivors run with these of the module's tests alone, the
    ones changed since the last run (a survivor has passed the others already); the mutants
    of functions changed since still run with all of them first."""
    tests = conf["tests"][module]
    saved = _saved(module)
    before = json.loads(saved.read_text()) if again and saved.exists() else None
    if only and not before:
        raise ValueError(f"--tests reruns the survivors of a saved run of {module}: none")
    files = {t.split("::")[0] for t in tests}
    if only and any(t.split("::")[0] not in files for t in only):
        raise ValueError(f"--tests {only}: not among {module}'s tests {tests}")
    dest = stage(module, tests, conf, keep=again)
    if before:
        (dest / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
    env = _env(module, conf)
    start = time.perf_counter()
    old = hashes(dest, module)
    try:
        mutmut_run(dest, module, jobs, [], env)
    except MutmutFailed:
        if statuses(dest, module):
            raise
        # mutmut stops when no test reaches a mutant: here there is none to reach
        return _save({"module": module, "tests": tests, "date": time.strftime("%Y-%m-%d"),
                      "status": {}, "survivors": {}, "jobs": jobs,
                      "seconds": round(time.perf_counter() - start, 1)})
    if before:
        known = statuses(dest, module)
        # mutmut made the mutants of functions new or changed since anew, and ran them
        changed = {f for f, h in hashes(dest, module).items() if old.get(f) != h}
        fresh = sum(n.split(".")[-1].rsplit("__mutmut_", 1)[0] in changed for n in known)
        # a result kept as counts names its survivors only; equivalents need no new look
        status = before.get("status", dict.fromkeys(before["survivors"], "survived"))
        rerun = [n for n, s in status.items() if s in ("survived", "no tests") and n in known
                 and n not in equivalent(conf)]
        if only:  # mutmut traces which of these tests reach each function anew
            stage(module, only, conf, keep=True)
            (dest / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
        mutmut_run(dest, module, jobs, rerun, env)
    result = in_workers(dest, verdicts(dest, module, tests, env), conf, env)
    seconds = time.perf_counter() - start
    result |= {"seconds": round(seconds, 1), "jobs": jobs}
    if again and (not before or before.get("stopped")):
        result["resumed"] = True
    elif again:
        result |= {k: before[k] for k in ("seconds", "jobs", "date", "resumed")
                   if k in before} | {
            "again": before.get("again", []) + [
                {"seconds": round(seconds, 1), "jobs": jobs, "date": time.strftime("%Y-%m-%d"),
                 "survivors": len(rerun)} | ({"tests": only} if only else {})
                | ({"new": fresh} if fresh else {})]}
    return _save(result)


def verdicts(dest: Path, module: str, tests: list[str], env: dict) -> dict:
    """Every mutant's status in ``dest`` and each survivor's diff (``mutmut show``)."""
    status = statuses(dest, module)
    return {"module": module, "tests": tests, "date": time.strftime("%Y-%m-%d"),
            "status": status, "survivors": _diffs(dest, status, env), "again": []}


def _diffs(dest: Path, status: dict[str, str], env: dict) -> dict[str, str]:
    """Each survivor's diff (``mutmut show``), those no test reached among them."""
    return {name: subprocess.run([*PASSES[PASS], "show", name], cwd=dest, env=env,
                                 capture_output=True, text=True).stdout
            for name, s in status.items() if s in ("survived", "no tests")}


def mutant_glob(module: str, function: str) -> str:
    """mutmut's names of the mutants of ``function`` (``name`` or ``Class.method``) of
    ``module``: ``gsgd_backends.inplace.x__finite__mutmut_*``."""
    prefix = import_path(module).removesuffix(".py").replace("/", ".")
    sep = "\u01c1"  # mutmut's separator of a class and its method
    name = sep + function.replace(".", sep) if "." in function else "_" + function
    return f"{prefix}.x{name}__mutmut_*"


def run_functions(module: str, functions: list[str], jobs: int, conf: dict) -> dict:
    """The mutants of ``functions`` of ``module`` alone, added to its saved result: for
    functions that had none when it ran (mutmut leaves decorated functions alone) or that
    changed since. Their verdicts replace any they had; the other mutants keep theirs. A
    result kept as ``counts`` holds theirs in ``status`` beside the counts."""
    saved = _saved(module)
    if not saved.exists():
        raise ValueError(f"--functions adds to a saved run of {module}: none")
    before = json.loads(saved.read_text())
    tests, patterns = conf["tests"][module], [mutant_glob(module, f) for f in functions]
    dest = stage(module, tests, conf, keep=True)
    (dest / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
    env = _env(module, conf)
    start = time.perf_counter()
    mutmut_run(dest, module, jobs, patterns, env)
    status = {n: s for n, s in statuses(dest, module).items()
              if any(fnmatch.fnmatch(n, p) for p in patterns)}
    if not status or "not checked" in status.values():
        raise RuntimeError(f"{functions}: no mutants, or some left without a verdict")
    survivors = _diffs(dest, status, env)
    result = in_workers(dest, {"module": module, "status": status, "survivors": survivors},
                        conf, env)
    seconds = time.perf_counter() - start
    if "counts" in before:
        before["counts"] = _uncounted(before, status, [mutant_glob(module, f) for f in functions])
    before["status"] = before.get("status", {}) | result["status"]
    before["survivors"] = {n: d for n, d in before["survivors"].items()
                           if n not in status} | result["survivors"]
    before["again"] = before.get("again", []) + [
        {"seconds": round(seconds, 1), "jobs": jobs, "date": time.strftime("%Y-%m-%d"),
         "functions": functions, "mutants": len(status)}]
    return _save(before)


def _uncounted(before: dict, status: dict[str, str], patterns: list[str]) -> dict[str, int]:
    """The ``counts`` of a result kept as counts, less the verdicts it held for the mutants
    of ``status``, which a run of their functions replaces. mutmut numbers a function's
    mutants in order, so a result that names one of a function's mutants as a survivor
    counted that function's mutants, the same names, each survivor as "survived" and the
    others as "killed"; a function none of whose mutants it names is taken to be new to it
    (mutmut left it alone when it ran)."""
    survivors = before["survivors"]
    counted = [p for p in patterns if any(fnmatch.fnmatch(n, p) for n in survivors)]
    old = collections.Counter(
        "survived" if n in survivors else "killed" for n in status
        if n not in before.get("status", {}) and any(fnmatch.fnmatch(n, p) for p in counted))
    return dict(collections.Counter(before["counts"]) - old)


def in_workers(dest: Path, result: dict, conf: dict, env: dict) -> dict:
    """The survivors of the functions that the tests reach only in processes they spawn
    (``torch.distributed`` workers), run again with those tests (``in_workers``).

    mutmut records which tests reach which function in its own process, so it runs none
    of these tests on such a function's mutants. Here pytest runs them with the mutant
    chosen by ``MUTANT_UNDER_TEST``, which the workers inherit, once the unmutated copy has
    passed them; a mutant they fail on counts as killed, and the result lists it."""
    table = conf.get("in_workers", {})
    todo = {name: tests for name in result["survivors"] for function, tests in table.items()
            if name.startswith(function + "__mutmut_")
            and name not in equivalent(conf)}
    if not todo:
        return result
    # the scripts these tests start import the mutated copy, which `MUTANT_UNDER_TEST` picks
    path = os.pathsep.join(filter(None, [str(dest / "mutants"), env.get("PYTHONPATH")]))

    def fails(mutant: str, tests: list[str]) -> bool:
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p",
                               "no:cacheprovider", *tests], cwd=dest / "mutants",
                              env=env | {"MUTANT_UNDER_TEST": mutant, "PYTHONPATH": path},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return done.returncode != 0

    for tests in {tuple(t) for t in todo.values()}:
        if fails("", list(tests)):
            raise RuntimeError(f"{list(tests)} fail on the unmutated copy of {result['module']}")
    killed = [name for name, tests in todo.items() if fails(name, tests)]
    for name in killed:
        result["status"][name] = "killed"
        del result["survivors"][name]
    return result | {"killed_in_workers": killed}


def save_stopped(module: str, conf: dict) -> dict:
    """The result of a run stopped before its end, from mutmut's folder: the mutants it
    left count as not run (out of the score); ``--again`` goes on from it."""
    dest = _staged(module)
    result = verdicts(dest, module, conf["tests"][module], os.environ)
    result["stopped"] = counts(result)["not checked"]
    return _save(result)


def run_time(r: dict) -> str:
    """The full run's time (or that of the part after a stop), and each later run of its
    survivors (``--again``)."""
    def took(run: dict) -> str:
        return f"{run['seconds'] / 60:.1f} min, {run['jobs']} job{'s' * (run['jobs'] > 1)}, " \
               f"{run['date']}"
    if "stopped" in r:   # its count may be 0: stopped after the last mutant, before the save
        return f"stopped before its end, {r['stopped']} mutants not run, {r['date']}"
    first = took(r) + (", the mutants left by a stopped run" if r.get("resumed") else "")
    return "; ".join([first] + [f"{_what_ran(a)}: {took(a)}" for a in r.get("again", [])])


def _what_ran(a: dict) -> str:
    """What a later run ran: the whole table again, named functions' mutants, or the
    survivors (with the mutants of functions changed since, and the narrow tests)."""
    def plural(n: int, word: str) -> str:
        return f"{n} {word}{'s' * (n != 1)}"
    if "all" in a:
        return f"all {a['all']} again, with a changed test table"
    if "functions" in a:
        return f"the {a['mutants']} mutants of " + ", ".join(f"`{f}`" for f in a["functions"])
    new = f"{plural(a['new'], 'new mutant')} and " if a.get("new") else ""
    narrow = " with " + ", ".join(f"`{t}`" for t in a["tests"]) if "tests" in a else ""
    return f"{new}{plural(a['survivors'], 'survivor')} again{narrow}"


def counts(result: dict) -> collections.Counter:
    """How many mutants have each status: the ``counts`` a result holds (a run whose
    per-mutant statuses were not kept) and those of ``status``."""
    return collections.Counter(result.get("counts", {})) + collections.Counter(
        result.get("status", {}).values())


#: The statuses of a caught mutant besides "killed": one that hangs the tests, and one
#: that crashes their process (a fused kernel the interpreter runs on a null pointer, or
#: one that writes past a buffer's end).
CAUGHT = ("timeout", "segfault", "abort")


def score(result: dict) -> tuple[int, int]:
    """``(killed, counted)``: killed counts mutmut's "killed" and those ``CAUGHT`` by a
    timeout or a crash; "no tests" counts as a survivor; the mutants a stopped run did not
    reach ("not checked") are not counted."""
    n = counts(result)
    return n["killed"] + sum(n[s] for s in CAUGHT), n.total() - n["skipped"] - n["not checked"]


def _results(kind: str) -> dict[str, dict]:
    """A pass's saved results by module."""
    found = sorted((RESULTS / _folder(kind)).glob("*.json"))
    return {r["module"]: r for r in (json.loads(p.read_text()) for p in found)}


def _score_cells(r: dict | None, why: dict[str, str]) -> list[str]:
    """A module's score in one pass, as the cells of the page's table: mutants, killed
    (of which timeouts and crashes), equivalent, score of the others, open survivors."""
    if r is None:
        return ["not run", "", "", "", ""]
    killed, counted = score(r)
    if not counted:
        return ["0", "", "", "no mutants", ""]
    left = _not_killed(r)
    same = sum(name in why for name in left)
    timeouts = sum(counts(r)[s] for s in CAUGHT)
    return [str(counted), f"{killed} ({timeouts})" if timeouts else str(killed), str(same),
            f"{100 * killed / max(counted - same, 1):.1f}%", str(len(left) - same)]


def _not_killed(r: dict) -> list[str]:
    """The mutants that survived, or that no test reached (each may be named equivalent); a
    result kept as counts names its survivors alone, beside the verdicts of the functions run
    since (``status``)."""
    status = r.get("status", {})
    counted = [n for n in r["survivors"] if n not in status] if "counts" in r else []
    return counted + [n for n, s in status.items() if s in ("survived", "no tests")]


def _run_times(results: dict[str, dict], conditions: dict[str, dict]) -> list[str]:
    """Each module's run times in each pass, one item a module (kept out of the table,
    whose cells they would widen past the page)."""
    out = []
    for module in sorted(set(results) | set(conditions)):
        runs = [f"{title}: {run_time(r[module])}" for title, r in (
            ("mutmut", results), ("condition-level", conditions)) if module in r]
        out.append(f"- `{module}`: " + "; ".join(runs))
    return out


def _survivors(results: dict[str, dict], why: dict[str, str], title: str) -> list[str]:
    """Each survivor of a pass with its diff, and why it is equivalent or that it is open."""
    out = []
    for r in results.values():
        if r.get("killed_in_workers"):
            out += ["", f"Killed in `{r['module']}` by tests in the processes they spawn "
                        "(`in_workers`): " + ", ".join(f"`{n}`" for n in r["killed_in_workers"])
                    + "."]
        left = _not_killed(r)
        if left:
            out += ["", f"## {title} in `{r['module']}`"]
        for name, diff in r["survivors"].items():
            out += ["", f"**`{name}`**: {why.get(name, 'open: no test kills it yet.')}", "",
                    "```diff", diff.strip(), "```"]
        unseen = [n for n in left if n not in r["survivors"]]
        if unseen:  # runs before diffs were kept for them
            out += ["", "Reached by no test (no diff kept):"] + [
                f"- **`{n}`**: {why.get(n, 'open: no test reaches it yet.')}" for n in unseen]
    return out


def _not_run(conf: dict, results: dict[str, dict]) -> str:
    """The modules of the table that a pass has no result for."""
    return ", ".join(f"`{m}`" for m in sorted(set(conf["tests"]) - set(results))) or "none"


def report(conf: dict) -> str:
    """The results page: score per module in each pass, then every survivor with its diff
    and either the reason it is equivalent (``equivalent``) or "open"."""
    results, conditions = _results("mutmut"), _results("conditions")
    why, why_conditions = equivalent(conf, "mutmut"), equivalent(conf, "conditions")
    out = ["# Mutation testing: results", "",
           "Produced by `python tests/mutation.py --report` from the runs of",
           "`python tests/mutation.py MODULE` (see [Testing](testing.md)). A mutant counts",
           "as killed when a test fails, times out or crashes its process on it; an",
           "equivalent mutant (no test can tell it from the original, for the reason given",
           "below) is left out of the score of the others, and so is one that only a GPU",
           "could tell (its reason says \"GPU only\"). mutmut runs on the CPU; the GPU-only",
           "mutants were planted one at a time on a GPU against the CUDA tests",
           "([Testing](testing.md#on-a-gpu)), and each reason says whether they killed it or",
           "why it is equivalent there too.", "",
           "Two passes: mutmut's own operators (the first five columns after the module),",
           "and the condition-level ones (`--pass conditions`, the last five): a condition",
           "made `True` or `False`, a guard deleted, an operand of `and`/`or` or a `not`",
           "dropped, a term of `+ - * /` dropped, a keyword argument dropped, a branch's",
           "`return` made `return None`, a public default made its type's zero. Each pass's",
           "columns: its mutants, those killed (the timeouts and crashes among them in",
           "parentheses), the equivalent or GPU-only survivors, the score of the others",
           "(killed over the mutants less the equivalent ones), the open survivors. The run",
           "times follow the table.", "",
           "| module | mutants | killed | equivalent | score | open "
           "| condition-level mutants | killed | equivalent | score | open |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for module in sorted(set(results) | set(conditions)):
        cells = _score_cells(results.get(module), why) + _score_cells(
            conditions.get(module), why_conditions)
        out.append(f"| `{module}` | " + " | ".join(cells) + " |")
    out += ["", f"Not run yet: {_not_run(conf, results)}.",
            f"Condition-level pass, not run yet: {_not_run(conf, conditions)}.",
            "GPU only, excluded: " + ", ".join(f"`{m}`" for m in conf["gpu_only"]) + ".",
            "", "## Run times", ""] + _run_times(results, conditions)
    return "\n".join(out + _survivors(results, why, "Survivors") + _survivors(
        conditions, why_conditions, "Condition-level survivors")) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help="e.g. backends/plan.py")
    parser.add_argument("--all", action="store_true", help="every module of the table")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--again", action="store_true",
                        help="keep the last run's verdicts; run its survivors and the mutants "
                             "of changed functions again")
    parser.add_argument("--tests", nargs="+", metavar="TEST",
                        help="with --again: run the survivors with these of the module's tests "
                             "only (those changed since its run)")
    parser.add_argument("--functions", nargs="+", metavar="NAME",
                        help="run the mutants of these functions (name, or Class.method) "
                             "alone and add them to the module's saved result")
    parser.add_argument("--stopped", action="store_true",
                        help="save the result of these modules' runs stopped before their end")
    parser.add_argument("--pass", dest="kind", choices=PASSES, default="mutmut",
                        help="mutmut's own operators, or the condition-level ones "
                             "(tests/mutation_conditions.py)")
    parser.add_argument("--report", action="store_true", help="write docs/mutation.md")
    args = parser.parse_args(argv)
    global PASS
    PASS = args.kind
    conf = settings()
    modules = list(conf["tests"]) if args.all else args.modules
    unknown = [m for m in modules if m not in conf["tests"]]
    if unknown:
        parser.error(f"not in [tool.gsgd.mutation.tests]: {unknown}")
    if args.tests and not args.again:
        parser.error("--tests goes with --again")
    if args.functions and (args.again or args.stopped or len(modules) != 1):
        parser.error("--functions goes with one module, without --again or --stopped")
    for module in modules:
        r = save_stopped(module, conf) if args.stopped else run_functions(
            module, args.functions, args.jobs, conf) if args.functions else run(
            module, args.jobs, conf, again=args.again, only=args.tests)
        killed, counted = score(r)
        print(f"{module}: {killed}/{counted} killed ({100 * killed / max(counted, 1):.1f}%), "
              f"{len(r['survivors'])} survivors; {run_time(r)}", flush=True)
    if args.report:
        (ROOT / "docs" / "mutation.md").write_text(report(conf))
    return 0


if __name__ == "__main__":
    sys.exit(main())
