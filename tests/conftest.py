"""Shared fixtures: the ``xp`` fixture over every installed array namespace, Hypothesis profile."""

import contextlib
import importlib.util
import os
import subprocess
import sys
from typing import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings

# Test helpers live beside this file; tests import them by module name (importlib mode).
sys.path.insert(0, os.path.dirname(__file__))

# The tests' workloads are tiny: extra threads only synchronise, and on a busy machine they
# spin waiting for cores other processes hold. One thread by default (GSGD_TEST_THREADS=N
# changes it), for torch, NumPy's BLAS and the processes the tests spawn (OMP_NUM_THREADS);
# tests of multi-threaded code paths take more with the ``threads`` fixture.
TEST_THREADS = int(os.environ.get("GSGD_TEST_THREADS", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(TEST_THREADS))
# Compiling, not running, is most of the JAX tests' time: each compiles many small programs
# (every eager operation is one) and runs them a few times. XLA's optimisations and its
# CPU fusion emitters cost more than they save here; without both, JAX's tests take about
# half the time. What the programs mean is unchanged (the tests compare within float
# tolerances). JAX_DISABLE_MOST_OPTIMIZATIONS=0 turns the first back on. Set before JAX
# starts; spawned processes (examples, benchmarks) and test workers inherit them.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# Keras reads its backend once, at import; the docs' Keras examples run in the test
# processes on JAX (tests/test_keras.py runs each backend in a process of its own).
os.environ.setdefault("KERAS_BACKEND", "jax")


def _probe_xla_flag(flag: str) -> Callable[[], None]:
    """A child process started to try ``flag`` (XLA aborts the process on an unknown flag),
    and a function that waits for it and adds ``flag`` to XLA_FLAGS where this jaxlib knows
    it (once: workers inherit the result). The child runs while torch is imported here."""
    flags = os.environ.get("XLA_FLAGS", "")
    if flag.split("=")[0] in flags or importlib.util.find_spec("jax") is None:
        return lambda: None
    flags = f"{flags} {flag}".strip()
    probe = subprocess.Popen([sys.executable, "-c", "import jax.numpy as jnp; jnp.zeros(1) + 1"],
                             env=os.environ | {"XLA_FLAGS": flags},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def add_if_known() -> None:
        if probe.wait(timeout=300) == 0:
            os.environ["XLA_FLAGS"] = flags
    return add_if_known


_add_xla_flag_if_known = _probe_xla_flag("--xla_cpu_use_fusion_emitters=false")
try:
    import torch
    torch.set_num_threads(TEST_THREADS)
except ImportError:
    torch = None
_add_xla_flag_if_known()
try:
    from threadpoolctl import threadpool_limits
    threadpool_limits(limits=TEST_THREADS)
except ImportError:
    pass

# Under mutmut (tests/mutation.py), each function of the mutated module is called through a
# trampoline defined in mutmut's own module. Name that module as the library's, so that
# gsgd_adapters.torch.warn.warn_user counts the trampolines' frames as the library's own,
# as it does the mutated functions', and the warnings still point at the test's line.
if "MUTANT_UNDER_TEST" in os.environ:  # set by mutmut in each of its runs
    import mutmut.mutation.trampoline

    mutmut.mutation.trampoline.__name__ = "gsgd_adapters.mutmut_trampoline"

from _helpers import process_group  # noqa: E402
from _namespaces import available_namespaces  # noqa: E402
from _strategies import fixed_shapes  # noqa: E402
from gsgd_backends._dispatch import FAST  # noqa: E402

# ``hxp`` is function-scoped only to hold JAX's fixed-shape context around a test; it keeps
# no per-example state, so Hypothesis may reuse it across examples.
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large,
          HealthCheck.function_scoped_fixture]
settings.register_profile("ci", derandomize=True, deadline=None, max_examples=25,
                          print_blob=True, suppress_health_check=_QUIET)
settings.register_profile("dev", deadline=None, max_examples=100, suppress_health_check=_QUIET)
# HYPOTHESIS_PROFILE=thorough: 20 times the examples, random (not derandomised) draws.
settings.register_profile("thorough", deadline=None, max_examples=500, print_blob=True,
                          suppress_health_check=_QUIET)
# HYPOTHESIS_PROFILE=mutate (tests/mutation.py): "ci" without shrinking, since a mutant needs
# one failing example, not the smallest one.
settings.register_profile("mutate", settings.get_profile("ci"),
                          phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _use(ns):
    if ns.skip_reason:
        pytest.skip(ns.skip_reason)
    return ns


@pytest.fixture(scope="session", params=available_namespaces(), ids=lambda ns: ns.id)
def xp(request):
    """Every array namespace and float dtype: numpy, array-api-strict, torch, jax, cupy."""
    return _use(request.param)


@pytest.fixture(scope="session", ids=lambda ns: ns.id,
                params=[ns for ns in available_namespaces() if ns.name in FAST])
def fxp(request):
    """The namespaces with a fast path (gsgd_backends): numpy, torch, cupy (float64 and
    float32)."""
    return _use(request.param)


@pytest.fixture(ids=lambda ns: ns.id, params=available_namespaces())
def hxp(request):
    """The namespaces Hypothesis draws chains on: every one. JAX compiles every operation
    anew for each new shape, so on JAX the chains' shapes come from a short fixed list
    (``_strategies.FIXED_SHAPES``); values, skeletons and rescalings are drawn as elsewhere."""
    ns = _use(request.param)
    with fixed_shapes() if ns.name == "jax" else contextlib.nullcontext():
        yield ns


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


@pytest.fixture
def one_process_group():
    """A gloo process group of this process alone, for DDP and FSDP2 in one test (the runs
    over several processes are in test_torch_ddp.py and test_fsdp.py)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed missing")
    with process_group():
        yield


@pytest.fixture
def threads():
    """Torch on every core for one test (a multi-threaded code path: ATen's parallel loops,
    inductor's OpenMP kernels); the suite's count afterwards."""
    if torch is None:
        pytest.skip("torch is not installed")
    n = max(os.cpu_count() or 1, 2)
    torch.set_num_threads(n)
    yield n
    torch.set_num_threads(TEST_THREADS)


# The files that take longest, longest first (each of them takes from 15 s to two minutes
# or more on one core: processes spawned, subprocesses importing torch, Keras or JAX,
# compiled programs, Triton's interpreter). Under xdist (``--dist loadfile
# --no-loadscope-reorder``) a worker takes whole files in the order of the collection, the
# next as it frees up. xdist's own order, the files with most tests first, leaves these
# few-test files last, so that the run ends with one worker on them while the other idles;
# started first, they run beside the many short files instead.
LONGEST_FIRST = ("test_benchmarks.py", "test_jax_catalogue.py", "test_keras.py",
                 "test_fsdp.py", "test_docs.py", "test_nnx.py", "test_jax_mesh.py",
                 "test_jax_guide.py", "test_hsdp.py", "test_readme.py", "test_torch_ddp.py",
                 "test_fused.py", "test_fused_optim.py", "test_fused_adam.py",
                 "test_recipe.py")


def pytest_collection_modifyitems(config, items):
    """Under xdist, the files of ``LONGEST_FIRST`` first, then the others with most tests
    first (xdist's order); each file's tests stay together, in their order."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    tests = {}
    for item in items:
        tests[item.path] = tests.get(item.path, 0) + 1

    def rank(path):
        first = LONGEST_FIRST.index(path.name) if path.name in LONGEST_FIRST else None
        return (0, first) if first is not None else (1, -tests[path])

    items.sort(key=lambda item: rank(item.path))
