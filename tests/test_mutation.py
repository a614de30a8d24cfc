"""The mutation-testing driver (tests/mutation.py): every module is in its table, a staged
copy puts each package under its import name, and scores and the page follow the runs."""

import difflib
import json
import sys
import tomllib
from pathlib import Path

import pytest

import mutation
import mutation_conditions

MODULES = sorted(str(p.relative_to(mutation.ROOT)) for folder in mutation.PACKAGES
                 for p in (mutation.ROOT / folder).rglob("*.py") if p.name != "__init__.py")


def test_every_module_has_tests_or_is_gpu_only():
    conf = mutation.settings()
    assert sorted(set(conf["tests"]) | set(conf["gpu_only"])) == MODULES
    assert not set(conf["tests"]) & set(conf["gpu_only"])
    for module, tests in conf["tests"].items():
        assert tests, module
        for test in tests:  # a file, or one test of it (a node id)
            path, _, name = test.partition("::")
            assert (mutation.ROOT / path).is_file(), (module, test)
            assert not name or f"def {name}(" in (mutation.ROOT / path).read_text(), test


def test_the_staged_copy_holds_the_packages_under_their_import_names(tmp_path, monkeypatch):
    monkeypatch.setattr(mutation, "BUILD", tmp_path)
    conf = mutation.settings()
    dest = mutation.stage("backends/plan.py", ["tests/test_step_plan.py"], conf)
    for name in ("gsgd_core", "gsgd_backends", "gsgd_adapters"):
        assert (dest / name / "__init__.py").is_file(), name
    assert (dest / "gsgd_backends" / "plan.py").read_text() == (
        mutation.ROOT / "backends" / "plan.py").read_text()
    assert (dest / "gsgd_adapters" / "torch" / "optim.py").is_file()
    table = tomllib.loads((dest / "pyproject.toml").read_text())["tool"]["mutmut"]
    assert table["only_mutate"] == ["gsgd_backends/plan.py"]
    assert table["source_paths"] == ["gsgd_backends/"]
    assert table["pytest_add_cli_args"] == conf["mutmut"]["pytest_add_cli_args"]
    assert table["pytest_add_cli_args_test_selection"] == ["tests/test_step_plan.py"]
    assert table["process_isolation"] == conf["mutmut"]["process_isolation"]
    assert table["forkserver_warmup"] == "collect"
    assert "preload_modules_file" not in table
    jax = mutation.stage("adapters/jax/norms.py", ["tests/test_jax_discovery.py"], conf)
    table = tomllib.loads((jax / "pyproject.toml").read_text())["tool"]["mutmut"]
    assert table["forkserver_warmup"] == "import", "JAX's tests are not collected before a fork"
    assert Path(table["preload_modules_file"]).read_text().split() == conf["preload"]
    assert "jax" in conf["preload"]


@pytest.mark.parametrize("module, path", [
    ("backends/plan.py", "gsgd_backends/plan.py"),
    ("adapters/torch/optim.py", "gsgd_adapters/torch/optim.py"),
    ("gsgd_core/sweeps.py", "gsgd_core/sweeps.py")])
def test_import_path(module, path):
    assert mutation.import_path(module) == path


def _result(tmp_path, module, status, survivors):
    r = {"module": module, "tests": [], "seconds": 90.0, "jobs": 2, "date": "2026-11-25",
         "status": status, "survivors": survivors}
    (tmp_path / (module.replace("/", ".") + ".json")).write_text(json.dumps(r))
    return r


def test_score_counts_timeouts_and_crashes_as_killed_and_missing_tests_as_survivors():
    r = {"status": {"a": "killed", "b": "timeout", "c": "survived", "d": "no tests",
                    "e": "skipped", "f": "segfault", "g": "abort", "h": "suspicious"}}
    assert mutation.score(r) == (4, 7)


def test_an_aborted_test_process_is_a_crash_and_other_odd_exit_codes_stay_suspicious(
        tmp_path):
    meta = tmp_path / "mutants" / "gsgd_backends" / "plan.py.meta"
    meta.parent.mkdir(parents=True)
    meta.write_text(json.dumps({"exit_code_by_key": {"a": -6, "b": -11, "c": 7, "d": 1}}))
    assert mutation.statuses(tmp_path, "backends/plan.py") == {
        "a": "abort", "b": "segfault", "c": "suspicious", "d": "killed"}


def test_a_mutant_no_test_reaches_counts_open_or_equivalent_as_a_survivor(tmp_path,
                                                                        monkeypatch):
    """"no tests" counts against the score: named equivalent, it leaves the score and the
    open count as a survivor does."""
    monkeypatch.setattr(mutation, "RESULTS", tmp_path)
    _result(tmp_path, "backends/plan.py",
            {"m1": "killed", "m2": "no tests", "m3": "no tests", "m4": "survived"}, {"m4": "-y"})
    page = mutation.report({"tests": {"backends/plan.py": []}, "gpu_only": [],
                            "equivalent": {"m2": "never called."}})
    assert "| `backends/plan.py` | 4 | 1 | 1 | 33.3% | 2 |" in page
    assert "- **`m2`**: never called." in page and "- **`m3`**: open" in page


def test_the_page_gives_every_score_and_every_survivor_with_its_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(mutation, "RESULTS", tmp_path)
    _result(tmp_path, "backends/plan.py",
            {"m1": "killed", "m2": "survived", "m3": "survived", "m4": "timeout"},
            {"m2": "--- a\n+++ b\n-x < 1\n+x <= 1", "m3": "-y\n+z"})
    conf = {"tests": {"backends/plan.py": [], "adapters/optax.py": []},
            "gpu_only": ["backends/cupy.py"], "equivalent": {"m2": "no dtype lies between."}}
    page = mutation.report(conf)
    assert "| `backends/plan.py` | 4 | 2 (1) | 1 | 66.7% | 1 | not run |" in page
    assert "- `backends/plan.py`: mutmut: 1.5 min, 2 jobs, 2026-11-25\n" in page
    assert "**`m2`**: no dtype lies between." in page
    assert "**`m3`**: open" in page and "+x <= 1" in page
    assert "Not run yet: `adapters/optax.py`." in page
    assert "GPU only, excluded: `backends/cupy.py`." in page


def test_staging_again_keeps_the_verdicts_and_replaces_the_rest(tmp_path, monkeypatch):
    """``--again`` restages the sources and tests beside mutmut's folder of the last run
    (its mutants and verdicts); a first run starts from nothing."""
    monkeypatch.setattr(mutation, "BUILD", tmp_path)
    conf = mutation.settings()
    dest = mutation.stage("backends/plan.py", ["tests/test_step_plan.py"], conf)
    for stale in (dest / "mutants" / "verdicts.meta", dest / "tests" / "test_gone.py"):
        stale.parent.mkdir(exist_ok=True)
        stale.write_text("x")
    mutation.stage("backends/plan.py", ["tests/test_step_plan.py"], conf, keep=True)
    assert (dest / "mutants" / "verdicts.meta").is_file()
    assert not (dest / "tests" / "test_gone.py").exists()
    assert (dest / "gsgd_backends" / "plan.py").is_file()
    mutation.stage("backends/plan.py", ["tests/test_step_plan.py"], conf)
    assert not (dest / "mutants").exists()


def test_the_page_gives_each_run_of_the_survivors_again(tmp_path, monkeypatch):
    monkeypatch.setattr(mutation, "RESULTS", tmp_path)
    r = _result(tmp_path, "backends/plan.py", {"m1": "killed", "m2": "survived"},
                {"m2": "-y\n+z"})
    r["again"] = [{"seconds": 30.0, "jobs": 1, "date": "2026-11-26", "survivors": 5}]
    (tmp_path / "backends.plan.py.json").write_text(json.dumps(r))
    page = mutation.report({"tests": {"backends/plan.py": []}, "gpu_only": []})
    assert ("`backends/plan.py`: mutmut: 1.5 min, 2 jobs, 2026-11-25; 5 survivors again: "
            "0.5 min, 1 job, 2026-11-26\n" in page)


def test_again_after_a_stopped_run_runs_only_what_it_left(tmp_path, monkeypatch):
    """A run stopped midway saved no result: ``--again`` runs the mutants without a verdict
    (mutmut's plain run) and reruns nothing else, and the page says it resumed. A later
    ``--again`` reruns that result's survivors too, with mutmut's record of the tests that
    reach each function rebuilt, and keeps saying so."""
    for name in ("BUILD", "RESULTS"):
        monkeypatch.setattr(mutation, name, tmp_path / name)
    runs = []
    monkeypatch.setattr(mutation, "mutmut_run", lambda dest, m, jobs, names, env:
                        runs.append(list(names)))
    monkeypatch.setattr(mutation, "statuses", lambda dest, m: {"a": "killed", "b": "survived"})
    monkeypatch.setattr(mutation.subprocess, "run", lambda *a, **k: type("P", (), {
        "stdout": "-x\n+y"})())
    conf = mutation.settings()
    stats = mutation._staged("backends/plan.py") / "mutants" / "mutmut-stats.json"
    stats.parent.mkdir(parents=True)
    stats.write_text("{}")
    r = mutation.run("backends/plan.py", 2, conf, again=True)
    assert runs == [[]] and r["resumed"] and r["again"] == [] and stats.is_file()
    assert "2026" in mutation.run_time(r) and "left by a stopped run" in mutation.run_time(r)
    runs.clear()
    r = mutation.run("backends/plan.py", 2, conf, again=True)
    assert runs == [[], ["b"]] and r["resumed"] and r["again"][0]["survivors"] == 1
    assert not stats.exists()


def test_a_stopped_run_is_saved_with_what_it_reached_and_again_goes_on(tmp_path, monkeypatch):
    """``--stopped`` saves a stopped run's verdicts: the mutants it did not reach are out of
    the score and named on the page; ``--again`` from it runs them and the survivors."""
    for name in ("BUILD", "RESULTS"):
        monkeypatch.setattr(mutation, name, tmp_path / name)
    monkeypatch.setattr(mutation, "statuses", lambda dest, m: {
        "a": "killed", "b": "survived", "c": "not checked", "d": "not checked"})
    monkeypatch.setattr(mutation.subprocess, "run", lambda *a, **k: type("P", (), {
        "stdout": "-x\n+y"})())
    conf = mutation.settings()
    r = mutation.save_stopped("backends/plan.py", conf)
    assert r["stopped"] == 2 and mutation.score(r) == (1, 2) and list(r["survivors"]) == ["b"]
    assert mutation.run_time(r) == f"stopped before its end, 2 mutants not run, {r['date']}"
    assert mutation.run_time(r | {"stopped": 0}).startswith("stopped before its end, 0 mutants")
    page = mutation.report({"tests": {"backends/plan.py": []}, "gpu_only": []})
    assert "| `backends/plan.py` | 2 | 1 | 0 | 50.0% | 1 |" in page
    runs = []
    monkeypatch.setattr(mutation, "mutmut_run", lambda dest, m, jobs, names, env:
                        runs.append(list(names)))
    r = mutation.run("backends/plan.py", 2, conf, again=True)
    assert runs == [[], ["b"]] and r["resumed"] and "stopped" not in r


def test_survivors_of_functions_reached_in_workers_run_those_tests_again(tmp_path, monkeypatch):
    """A survivor of a function in ``in_workers`` runs its tests again with the mutant
    chosen in the environment, after the unmutated copy (``""``) has passed them; a failure
    kills it. Equivalent mutants and other functions' survivors (one whose name only begins
    alike among them) are left alone, and a failure on the unmutated copy stops the run."""
    import subprocess
    from types import SimpleNamespace

    function = "gsgd_adapters.torch.optim.x\u01c1GSGD\u01c1_apply"
    caught, missed, other, same = (function + "__mutmut_1", function + "__mutmut_2",
                                   function + "_other__mutmut_1", function + "__mutmut_3")
    result = {"module": "adapters/torch/optim.py",
              "status": {n: "survived" for n in (caught, missed, other, same)},
              "survivors": {n: "diff" for n in (caught, missed, other, same)}}
    conf = {"in_workers": {function: ["tests/test_fsdp.py"]}, "equivalent": {same: "why"}}
    ran, fail_on = [], {caught}

    def run(args, cwd, env, **kwargs):
        assert args[-1] == "tests/test_fsdp.py" and cwd == tmp_path / "mutants"
        ran.append(env["MUTANT_UNDER_TEST"])
        return SimpleNamespace(returncode=int(env["MUTANT_UNDER_TEST"] in fail_on))

    monkeypatch.setattr(subprocess, "run", run)
    out = mutation.in_workers(tmp_path, json.loads(json.dumps(result)), conf, {})
    assert ran == ["", caught, missed]
    assert out["status"] == {caught: "killed", missed: "survived", other: "survived",
                             same: "survived"}
    assert set(out["survivors"]) == {missed, other, same}
    assert out["killed_in_workers"] == [caught]
    fail_on.add("")
    with pytest.raises(RuntimeError, match="fail on the unmutated copy"):
        mutation.in_workers(tmp_path, json.loads(json.dumps(result)), conf, {})


def test_the_run_time_counts_the_reruns_in_workers(tmp_path, monkeypatch):
    """A run's time is mutmut's runs and the reruns of survivors in workers together."""
    for name in ("BUILD", "RESULTS"):
        monkeypatch.setattr(mutation, name, tmp_path / name)
    clock = [0.0]

    def spend(seconds):
        clock[0] += seconds

    monkeypatch.setattr(mutation.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(mutation, "mutmut_run", lambda *args: spend(60.0))
    monkeypatch.setattr(mutation, "statuses", lambda dest, m: {"a": "killed"})
    monkeypatch.setattr(mutation, "in_workers", lambda dest, result, conf, env:
                        spend(120.0) or result)
    assert mutation.run("backends/plan.py", 2, mutation.settings())["seconds"] == 180.0


def _seen(tmp_path, monkeypatch, module: str, variable: str) -> list:
    """``variable`` in the environment of each mutmut run of ``module`` (unset outside)."""
    for name in ("BUILD", "RESULTS"):
        monkeypatch.setattr(mutation, name, tmp_path / name)
    monkeypatch.delenv(variable, raising=False)
    envs = []
    monkeypatch.setattr(mutation, "mutmut_run", lambda dest, m, jobs, names, env:
                        envs.append(env))
    monkeypatch.setattr(mutation, "statuses", lambda dest, m: {"a": "killed"})
    mutation.run(module, 2, mutation.settings())
    return [env.get(variable) for env in envs]


@pytest.mark.parametrize("module, disabled", [("backends/fast.py", True),
                                              ("backends/sharded.py", False)])
def test_modules_torch_compile_traces_run_their_tests_eagerly(tmp_path, monkeypatch, module,
                                                               disabled):
    """dynamo cannot trace mutmut's trampolines: the tests of a ``dynamo_off`` module run
    with ``TORCH_COMPILE_DISABLE=1``, and only those."""
    assert _seen(tmp_path, monkeypatch, module, "TORCH_COMPILE_DISABLE") == [
        "1" if disabled else None]


@pytest.mark.parametrize("module, backend", [("adapters/keras/units.py", "torch"),
                                             ("adapters/torch/ddp.py", None)])
def test_a_modules_env_setting_reaches_its_tests_alone(tmp_path, monkeypatch, module, backend):
    """``env``: the Keras modules' tests run the Keras cases in mutmut's process on the
    torch backend (Keras reads ``KERAS_BACKEND`` once); other modules' tests see none."""
    assert _seen(tmp_path, monkeypatch, module, "KERAS_BACKEND") == [backend]


def test_the_scripts_a_modules_tests_start_import_its_staged_copy(tmp_path, monkeypatch):
    """A test's ``torch.distributed.run`` script (the FSDP example) imports the staged
    sources, with or without an installed gsgd."""
    path, = _seen(tmp_path, monkeypatch, "backends/sharded.py", "PYTHONPATH")
    staged = mutation._staged("backends/sharded.py")
    assert path == str(staged) and staged.is_relative_to(tmp_path)


def test_a_module_without_mutants_is_saved_as_such_and_other_failures_raise(tmp_path,
                                                                            monkeypatch):
    """mutmut stops with an error when no test reaches a mutant. With no mutant at all (a
    module of Triton kernels alone) the run is saved with none and the page says so; with
    mutants, the error is raised with the tests' output, not the spinner's frames."""
    for name in ("BUILD", "RESULTS"):
        monkeypatch.setattr(mutation, name, tmp_path / name)
    made = {}
    monkeypatch.setattr(mutation, "statuses", lambda dest, m: made)
    monkeypatch.setattr(mutation.subprocess, "run", lambda *a, **k: type("P", (), {
        "returncode": 1, "stdout": "E   assert 1 == 2\n" + "\r⠋ Running stats" * 500})())
    conf = mutation.settings()
    r = mutation.run("backends/fused_psi_kernels.py", 2, conf)
    assert r["status"] == {} and mutation._saved("backends/fused_psi_kernels.py").is_file()
    page = mutation.report({"tests": {"backends/fused_psi_kernels.py": []}, "gpu_only": []})
    assert "| `backends/fused_psi_kernels.py` | 0 |  |  | no mutants |  |" in page
    made["x__mutmut_1"] = "not checked"
    with pytest.raises(mutation.MutmutFailed, match="assert 1 == 2") as failed:
        mutation.run("backends/fused_kernels.py", 2, conf)
    assert "⠋" not in str(failed.value)
    assert not mutation._saved("backends/fused_kernels.py").exists()


def test_a_result_kept_as_counts_scores_and_reruns_as_one_kept_by_mutant(tmp_path,
                                                                          monkeypatch):
    """A result that holds ``counts`` instead of every mutant's status gives the same row,
    and ``--again`` reruns the survivors it names."""
    for name in ("BUILD", "RESULTS"):
        monkeypatch.setattr(mutation, name, tmp_path / name)
    status = {"m1": "killed", "m2": "survived", "m3": "timeout", "m4": "skipped"}
    by_mutant = {"module": "backends/plan.py", "tests": [], "seconds": 90.0, "jobs": 2,
                 "date": "2026-11-25", "status": status, "survivors": {"m2": "-y\n+z"},
                 "again": []}
    as_counts = {k: v for k, v in by_mutant.items() if k != "status"} | {
        "counts": {"killed": 1, "survived": 1, "timeout": 1, "skipped": 1}}
    conf = {"tests": {"backends/plan.py": []}, "gpu_only": []}
    pages = []
    for r in (by_mutant, as_counts):
        mutation._save(r)
        pages.append(mutation.report(conf))
    assert pages[0] == pages[1]
    assert "| `backends/plan.py` | 3 | 2 (1) | 0 | 66.7% | 1 |" in pages[1]
    runs = []
    monkeypatch.setattr(mutation, "mutmut_run", lambda dest, m, jobs, names, env:
                        runs.append(list(names)))
    monkeypatch.setattr(mutation, "statuses", lambda dest, m: status)
    monkeypatch.setattr(mutation.subprocess, "run", lambda *a, **k: type("P", (), {
        "stdout": "-y\n+z"})())
    mutation.run("backends/plan.py", 2, mutation.settings(), again=True)
    assert runs == [[], ["m2"]]


@pytest.mark.parametrize("module", ["adapters/jax/walk.py", "backends/plan.py",
                                    "gsgd_core/group.py"])
def test_every_run_shares_a_jax_compilation_cache(tmp_path, monkeypatch, module):
    """Each mutant's child would compile the JAX tests' functions anew (the JAX adapters'
    tests, and the JAX namespace cases of every other module's): every run shares XLA's
    persistent cache under the build folder, every compilation kept."""
    for name in ("BUILD", "RESULTS"):
        monkeypatch.setattr(mutation, name, tmp_path / name)
    envs = []
    monkeypatch.setattr(mutation, "mutmut_run", lambda dest, m, jobs, names, env:
                        envs.append(env))
    monkeypatch.setattr(mutation, "statuses", lambda dest, m: {"a": "killed"})
    mutation.run(module, 2, mutation.settings())
    assert envs[0]["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    assert envs[0]["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] == "0"
    assert envs[0]["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "BUILD" / "jax-cache")


def test_survivors_run_again_with_the_tests_changed_since_alone(tmp_path, monkeypatch):
    """``--again --tests`` runs the mutants without a verdict (of functions changed since)
    with all the module's tests, then the survivors with the named ones alone, traced anew;
    the result keeps the module's tests and names the narrow ones in its rerun. Refused:
    without a saved run, and tests that are not the module's."""
    for name in ("BUILD", "RESULTS"):
        monkeypatch.setattr(mutation, name, tmp_path / name)
    module, narrow = "adapters/jax/units.py", ["tests/test_jax_discovery.py"]
    conf = mutation.settings()
    with pytest.raises(ValueError, match="saved run"):
        mutation.run(module, 2, conf, again=True, only=narrow)
    status = {"a": "killed", "b": "survived", "c": "no tests"}
    mutation._save({"module": module, "tests": conf["tests"][module], "seconds": 60.0,
                    "jobs": 2, "date": "2026-11-25", "status": status,
                    "survivors": {"b": "-x\n+y"}, "again": []})
    runs = []

    def mutmut_run(dest, m, jobs, names, env):
        mutmut = tomllib.loads((dest / "pyproject.toml").read_text())["tool"]["mutmut"]
        stats = dest / "mutants" / "mutmut-stats.json"
        runs.append((list(names), mutmut["pytest_add_cli_args_test_selection"], stats.exists()))
        stats.parent.mkdir(parents=True, exist_ok=True)
        stats.write_text("{}")
    monkeypatch.setattr(mutation, "mutmut_run", mutmut_run)
    monkeypatch.setattr(mutation, "statuses", lambda dest, m: status)
    monkeypatch.setattr(mutation.subprocess, "run", lambda *a, **k: type("P", (), {
        "stdout": "-x\n+y"})())
    with pytest.raises(ValueError, match="not among"):
        mutation.run(module, 2, conf, again=True, only=["tests/test_optax.py"])
    r = mutation.run(module, 2, conf, again=True, only=narrow)
    assert runs == [([], conf["tests"][module], False), (["b", "c"], narrow, False)]
    assert r["tests"] == conf["tests"][module] and r["again"][0]["tests"] == narrow
    assert "2 survivors again with `tests/test_jax_discovery.py`: " in mutation.run_time(r)


@pytest.mark.parametrize("function, pattern", [
    ("_finite", "gsgd_backends.inplace.x__finite__mutmut_*"),
    ("GSGD.step", "gsgd_backends.inplace.x\u01c1GSGD\u01c1step__mutmut_*")])
def test_mutant_glob_names_a_functions_mutants_as_mutmut_does(function, pattern):
    assert mutation.mutant_glob("backends/inplace.py", function) == pattern


def test_a_functions_mutants_are_added_to_a_saved_result(tmp_path, monkeypatch):
    """``--functions`` runs the named functions' mutants alone (mutmut's record of the tests
    rebuilt) and adds their verdicts to the saved result, kept as counts or by mutant, in
    place of any they had; the other mutants keep theirs, and the page says what ran."""
    for name in ("BUILD", "RESULTS"):
        monkeypatch.setattr(mutation, name, tmp_path / name)
    module, conf = "backends/inplace.py", mutation.settings()
    with pytest.raises(ValueError, match="saved run"):
        mutation.run_functions(module, ["_finite"], 2, conf)
    mutation._save({"module": module, "tests": [], "seconds": 60.0, "jobs": 2,
                    "date": "2026-11-25", "counts": {"killed": 5, "survived": 1},
                    "survivors": {"old": "-a\n+b"}, "again": []})
    f = "gsgd_backends.inplace.x__finite__mutmut_"
    status = {f + "1": "killed", f + "2": "survived", "gsgd_backends.inplace.x_other__mutmut_1":
              "not checked"}
    runs = []

    def mutmut_run(dest, m, jobs, names, env):
        runs.append((list(names), (dest / "mutants" / "mutmut-stats.json").exists()))
    monkeypatch.setattr(mutation, "mutmut_run", mutmut_run)
    monkeypatch.setattr(mutation, "statuses", lambda dest, m: status)
    monkeypatch.setattr(mutation.subprocess, "run", lambda *a, **k: type("P", (), {
        "stdout": "-x\n+y"})())
    stats = mutation._staged(module) / "mutants" / "mutmut-stats.json"
    stats.parent.mkdir(parents=True)
    stats.write_text("{}")
    r = mutation.run_functions(module, ["_finite"], 2, conf)
    assert runs == [([f + "*"], False)]
    assert mutation.score(r) == (6, 8) and set(r["survivors"]) == {"old", f + "2"}
    assert r["status"] == {f + "1": "killed", f + "2": "survived"}
    assert "; the 2 mutants of `_finite`: " in mutation.run_time(r)
    status[f + "2"] = "killed"   # a second run, with a new test, replaces the verdicts
    r = mutation.run_functions(module, ["_finite"], 2, conf)
    assert mutation.score(r) == (7, 8) and set(r["survivors"]) == {"old"}
    assert len(r["again"]) == 2
    status[f + "2"] = "not checked"
    with pytest.raises(RuntimeError, match="without a verdict"):
        mutation.run_functions(module, ["_finite"], 2, conf)


def test_a_result_kept_as_counts_loses_the_verdicts_a_functions_run_replaces():
    """Run again, a function whose mutants a counts-kept result named among its survivors
    had all its mutants counted there (the named as survivors, the others as killed): their
    new verdicts replace those; a function it names none of is new to it."""
    f, g = "m.x_f__mutmut_", "m.x_g__mutmut_"
    before = {"counts": {"killed": 10, "survived": 2}, "survivors": {f + "2": "", "other": ""}}
    status = {f + "1": "killed", f + "2": "killed", f + "3": "survived", g + "1": "killed"}
    assert mutation._uncounted(before, status, ["m.x_f__mutmut_*", "m.x_g__mutmut_*"]) == {
        "killed": 8, "survived": 1}
    after = {"counts": mutation._uncounted(before, status, ["m.x_f__mutmut_*"]),
             "status": status, "survivors": {"other": "", f + "3": ""}}
    assert mutation.score(after) == (11, 13)
    assert sorted(mutation._not_killed(after)) == [f + "3", "other"]
    # a second run of the same function: its verdicts are in ``status`` already, not counts
    before["status"] = dict.fromkeys(status, "killed")
    assert mutation._uncounted(before, status, ["m.x_f__mutmut_*"]) == before["counts"]


def test_the_page_counts_the_mutants_of_functions_changed_since(tmp_path, monkeypatch):
    """``--again`` after functions changed runs their mutants (mutmut makes them anew) as
    well as the survivors; the page counts both, from mutmut's hash of each function."""
    for name in ("BUILD", "RESULTS"):
        monkeypatch.setattr(mutation, name, tmp_path / name)
    module, conf = "backends/plan.py", mutation.settings()
    mutation._save({"module": module, "tests": [], "seconds": 60.0, "jobs": 2,
                    "date": "2026-11-25", "counts": {"killed": 2},
                    "survivors": {"m.x_g__mutmut_1": "-x\n+y"}, "again": []})
    runs = iter([{"x_f": "1", "x_g": "1", "x_h": "1"}, {"x_f": "2", "x_g": "1", "x_h": "1",
                                                        "x_k": "3"}])
    monkeypatch.setattr(mutation, "hashes", lambda dest, m: next(runs))
    monkeypatch.setattr(mutation, "mutmut_run", lambda *a: None)
    monkeypatch.setattr(mutation, "statuses", lambda dest, m: {
        "m.x_f__mutmut_1": "killed", "m.x_f__mutmut_2": "killed", "m.x_g__mutmut_1": "killed",
        "m.x_h__mutmut_1": "killed", "m.x_k__mutmut_1": "killed"})
    r = mutation.run(module, 2, conf, again=True)
    assert r["again"][0]["new"] == 3
    assert "; 3 new mutants and 1 survivor again: " in mutation.run_time(r)


def _changes(code: str) -> list[tuple[str, ...]]:
    """Each condition-level mutant of ``code`` as the lines it removes and adds."""
    def stripped(text):
        return [line.strip() for line in text.splitlines() if line.strip()]
    out = []
    for function, mutant in mutation_conditions.mutants(code):
        diff = difflib.ndiff(stripped(function), stripped(mutant))
        out.append(tuple(line for line in diff if line[:2] in ("- ", "+ ")))
    return out


def test_conditions_become_true_and_false_and_a_guard_is_deleted():
    """Every condition of an ``if``/``elif``/``while``/``assert``, a conditional expression
    and a comprehension's filter becomes ``True`` and ``False``; a guard's ``False`` is the
    guard deleted, an ``elif``'s is not (its ``if`` would lose its branch)."""
    code = ("def f(x, ys):\n"
            "    if x is None:\n"
            "        raise ValueError('x')\n"
            "    if x > 1:\n"
            "        x = 1\n"
            "    elif x < 0:\n"
            "        return 0\n"
            "    while x:\n"
            "        x -= 1\n"
            "    assert x == 0, 'm'\n"
            "    return [y for y in ys if y] if x else ys\n")
    found = _changes(code)
    for old, new in [("if x is None:", "if True:"), ("if x > 1:", "if True:"),
                     ("if x > 1:", "if False:"), ("elif x < 0:", "elif True:"),
                     ("elif x < 0:", "elif False:"), ("while x:", "while True:"),
                     ("while x:", "while False:"), ("assert x == 0, 'm'", "assert True, 'm'"),
                     ("assert x == 0, 'm'", "assert False, 'm'")]:
        assert ("- " + old, "+ " + new) in found, (old, new)
    assert ("+ pass", "- if x is None:", "- raise ValueError('x')") in found
    assert ("- if x is None:", "+ if False:") not in found
    ret = "- return [y for y in ys if y] if x else ys"
    for new in ("[y for y in ys if True] if x else ys", "[y for y in ys if False] if x else ys",
                "[y for y in ys if y] if True else ys", "[y for y in ys if y] if False else ys"):
        assert (ret, "+ return " + new) in found, new
    assert len(found) == 15


@pytest.mark.parametrize("body, guard", [
    ("        return x\n", True), ("        continue\n", True), ("        break\n", True),
    ("        warnings.warn('w')\n        return\n", True), ("        x = 1\n", False),
    ("        raise ValueError\n    else:\n        pass\n", False)])
def test_a_guard_is_an_if_that_only_leaves_or_warns(body, guard):
    import libcst as cst

    loop = f"for x in y:\n    if x:\n{body}"
    node = cst.parse_module(loop).body[0].body.body[0]
    assert mutation_conditions.is_guard(node) is guard


def test_each_operand_of_and_or_and_each_not_is_dropped():
    """``a and b and c`` loses each operand once (three mutants, not four); parentheses
    stay where the dropped expression had them."""
    found = _changes("def f(a, b, c, d):\n"
                     "    x = a and b and c\n"
                     "    return not (x or d), -a\n")
    assert sorted(found) == sorted([
        ("- x = a and b and c", "+ x = a and b"), ("- x = a and b and c", "+ x = a and c"),
        ("- x = a and b and c", "+ x = b and c"),
        ("- return not (x or d), -a", "+ return not (x), -a"),
        ("- return not (x or d), -a", "+ return not (d), -a"),
        ("- return not (x or d), -a", "+ return (x or d), -a")])


def test_each_term_of_a_sum_difference_product_or_quotient_is_dropped():
    """Each operand of ``+ - * /`` once (``x - x`` makes one mutant), no other operator's."""
    found = _changes("def f(x, y, z):\n"
                     "    return x - y * 2, x / z + 1, x ** 2, x % y, x - x\n")
    line = "- return x - y * 2, x / z + 1, x ** 2, x % y, x - x"
    assert sorted(new for _, new in found) == sorted("+ return " + terms + ", x % y" + rest
                                                     for terms, rest in (
        ("x, x / z + 1, x ** 2", ", x - x"), ("y * 2, x / z + 1, x ** 2", ", x - x"),
        ("x - y, x / z + 1, x ** 2", ", x - x"), ("x - 2, x / z + 1, x ** 2", ", x - x"),
        ("x - y * 2, x / z, x ** 2", ", x - x"), ("x - y * 2, 1, x ** 2", ", x - x"),
        ("x - y * 2, x + 1, x ** 2", ", x - x"), ("x - y * 2, z + 1, x ** 2", ", x - x"),
        ("x - y * 2, x / z + 1, x ** 2", ", x")))
    assert all(old == line for old, _ in found)


def test_each_keyword_argument_is_dropped():
    assert sorted(_changes("def f(g, x):\n    return g(x, k=1, **{'m': 2})\n")) == [
        ("- return g(x, k=1, **{'m': 2})", "+ return g(x, **{'m': 2})")]


def test_a_return_in_a_branch_becomes_none_where_its_function_has_another():
    """Only a ``return EXPR`` in a branch of a function with another ``return``: not the
    last one of the body, not one that returns None already, not a function's only one,
    and a function defined inside counts its own."""
    found = _changes("def f(x):\n"
                     "    def g(y):\n"
                     "        for z in y:\n"
                     "            return z\n"
                     "    if x:\n"
                     "        return g(x)\n"
                     "    elif x is None:\n"
                     "        return None\n"
                     "    return 0\n")
    assert all(found), "every mutant changes the code"
    returns = [c for c in found if any("return" in line for line in c)]
    assert ("- return g(x)", "+ return None") in returns
    assert ("- return z", "+ return None") not in found
    assert ("- return 0", "+ return None") not in found
    assert len([c for c in returns if c[-1] == "+ return None"]) == 1


def test_a_public_functions_defaults_become_their_types_zero():
    """Public functions and the methods of public classes (``__init__`` among them): ints,
    floats, ``True`` and strings become ``0``, ``0.0``, ``False`` and ``""``; a default
    that is its zero, ``None`` or a name is left, and so are private functions, methods of
    private classes and functions defined inside others."""
    found = _changes("def f(a=2, *, b=0.5, c=True, d='x', e=None, g=0, h=False, k=N, s=''):\n"
                     "    def inner(m=3):\n"
                     "        return m\n"
                     "    return inner()\n"
                     "def _private(n=4):\n"
                     "    return n\n"
                     "class Public:\n"
                     "    def __init__(self, lr=0.1):\n"
                     "        pass\n"
                     "class _Hidden:\n"
                     "    def method(self, lr=0.1):\n"
                     "        pass\n")
    old = "- def f(a=2, *, b=0.5, c=True, d='x', e=None, g=0, h=False, k=N, s=''):"
    assert sorted(found) == sorted([
        (old, "+ def f(a=0, *, b=0.5, c=True, d='x', e=None, g=0, h=False, k=N, s=''):"),
        (old, "+ def f(a=2, *, b=0.0, c=True, d='x', e=None, g=0, h=False, k=N, s=''):"),
        (old, "+ def f(a=2, *, b=0.5, c=False, d='x', e=None, g=0, h=False, k=N, s=''):"),
        (old, "+ def f(a=2, *, b=0.5, c=True, d=\"\", e=None, g=0, h=False, k=N, s=''):"),
        ("- def __init__(self, lr=0.1):", "+ def __init__(self, lr=0.0):")])


def test_the_conditions_pass_runs_its_operators_in_folders_of_its_own(tmp_path, monkeypatch):
    """``--pass conditions`` runs mutmut through ``mutation_conditions.py`` in a copy and
    with results of its own, whose equivalents are its own table's; mutmut's pass keeps
    its folders."""
    for name in ("BUILD", "RESULTS"):
        monkeypatch.setattr(mutation, name, tmp_path / name)
    commands = []
    monkeypatch.setattr(mutation.subprocess, "run", lambda args, cwd, **k: commands.append(
        (args, cwd)) or type("P", (), {"returncode": 0, "stdout": "-x\n+y"})())
    monkeypatch.setattr(mutation, "statuses", lambda dest, m: {"a": "killed", "b": "survived"})
    conf = mutation.settings()
    module = "gsgd_core/chain.py"
    monkeypatch.setattr(mutation, "PASS", "conditions")
    r = mutation.run(module, 1, conf)
    dest = tmp_path / "BUILD" / "conditions" / "gsgd_core.chain.py"
    script = str(mutation.ROOT / "tests" / "mutation_conditions.py")
    assert commands[0] == ([sys.executable, script, "run", "--max-children", "1"], dest)
    assert commands[1] == ([sys.executable, script, "show", "b"], dest)
    assert (tmp_path / "RESULTS" / "conditions" / "gsgd_core.chain.py.json").is_file()
    assert not (tmp_path / "RESULTS" / "gsgd_core.chain.py.json").exists()
    assert r["survivors"] == {"b": "-x\n+y"}
    assert mutation.equivalent({"equivalent": {"m": "1"}, "conditions": {
        "equivalent": {"c": "2"}}}) == {"c": "2"}
    monkeypatch.setattr(mutation, "PASS", "mutmut")
    commands.clear()
    mutation.run(module, 1, conf)
    assert commands[0][0][0] == str(mutation.MUTMUT)
    assert commands[0][1] == tmp_path / "BUILD" / "gsgd_core.chain.py"


def test_the_page_gives_each_pass_a_column_and_its_survivors(tmp_path, monkeypatch):
    monkeypatch.setattr(mutation, "RESULTS", tmp_path)
    _result(tmp_path, "backends/plan.py", {"m1": "killed", "m2": "survived"}, {"m2": "-y\n+z"})
    (tmp_path / "conditions").mkdir()
    _result(tmp_path / "conditions", "backends/plan.py",
            {"m1": "killed", "m2": "killed", "m3": "survived", "m4": "survived",
             "m5": "timeout"}, {"m3": "-if x:\n+if True:", "m4": "-a and b\n+a"})
    _result(tmp_path / "conditions", "adapters/cupy.py", {"m1": "killed"}, {})
    conf = {"tests": {"backends/plan.py": [], "adapters/cupy.py": [], "gsgd_core/chain.py": []},
            "gpu_only": [], "equivalent": {"m2": "no dtype lies between."},
            "conditions": {"equivalent": {"m3": "x is never falsy here."}}}
    page = mutation.report(conf)
    assert "| `backends/plan.py` | 2 | 1 | 1 | 100.0% | 0 | 5 | 3 (1) | 1 | 75.0% | 1 |" in page
    assert "| `adapters/cupy.py` | not run |  |  |  |  | 1 | 1 | 0 | 100.0% | 0 |" in page
    assert ("- `backends/plan.py`: mutmut: 1.5 min, 2 jobs, 2026-11-25; condition-level: "
            "1.5 min, 2 jobs, 2026-11-25\n") in page
    assert "- `adapters/cupy.py`: condition-level: 1.5 min, 2 jobs, 2026-11-25\n" in page
    assert "Not run yet: `adapters/cupy.py`, `gsgd_core/chain.py`." in page
    assert "Condition-level pass, not run yet: `gsgd_core/chain.py`." in page
    conditions = page.split("## Condition-level survivors in `backends/plan.py`")[1]
    assert "**`m3`**: x is never falsy here." in conditions
    assert "**`m4`**: open" in conditions and "**`m2`**" not in conditions
    assert "**`m2`**: no dtype lies between." in page.split("## Condition-level")[0]
