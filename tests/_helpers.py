"""Small helpers shared by the tests: tolerances and the data of one random problem."""

from __future__ import annotations

import contextlib
import importlib
import os
import pathlib
import sys

import numpy as np
import pytest

from _nets import loss_and_grads, make_data
from _strategies import random_params


#: For tests whose models step from their default init (compared with the core,
#: checkpointed, run across processes): the skeleton warning is expected there. Its own
#: tests use ``pytest.warns``, which still sees it.
DEFAULT_INIT = pytest.mark.filterwarnings("ignore::gsgd_adapters.torch.SkeletonWarning")


@contextlib.contextmanager
def triton_interpreting(compiled: bool = False):
    """``TRITON_INTERPRET=1`` inside, as it was outside (Triton decides at a kernel's
    definition whether it is interpreted, and checks again at each launch); nothing where
    the kernels run ``compiled`` (a CUDA device)."""
    if compiled:
        yield
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def reverse_axes(a):
    """A view of ``a`` (NumPy or torch) with its axes reversed: not contiguous for 2+ axes
    (torch deprecates ``.T`` beyond two)."""
    axes = tuple(range(a.ndim - 1, -1, -1))
    return a.permute(*axes) if hasattr(a, "permute") else np.transpose(a, axes)


def assert_close(actual, expected, rtol, what=""):
    """``|actual - expected| <= rtol * (max|expected| + 1)``, elementwise (None == None)."""
    if expected is None:
        assert actual is None, what
        return
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    scale = float(np.max(np.abs(expected), initial=0.0)) + 1.0
    err = float(np.max(np.abs(actual - expected), initial=0.0))
    assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol:.1g} * {scale:.3g}"


def assert_all_close(actuals, expecteds, rtol, what=""):
    assert len(actuals) == len(expecteds)
    for i, (a, e) in enumerate(zip(actuals, expecteds)):
        assert_close(a, e, rtol, f"{what}[{i}]")


def record_calls(monkeypatch, module, names) -> list[str]:
    """Wrap each function ``names`` of ``module`` so that a call appends its name to the
    list returned, then runs it (which of torch's implementations a step takes)."""
    used = []

    def spied(name):
        run = getattr(module, name)

        def spy(*args, **kwargs):
            used.append(name)
            return run(*args, **kwargs)
        return spy

    for name in names:
        monkeypatch.setattr(module, name, spied(name))
    return used


class Problem:
    """Host float64 weights, biases, data and gradients of one random chain problem."""

    def __init__(self, chain, seed):
        self.chain = chain
        self.rng = np.random.default_rng(seed)
        self.W, self.b = random_params(chain, self.rng)
        self.x, self.y = make_data(chain, self.rng)

    def grads(self, W=None, b=None):
        _, G, Gb = loss_and_grads(self.chain, self.W if W is None else W,
                                  self.b if b is None else b, self.x, self.y)
        return G, Gb

    def in_jax(self):
        """The weights, biases and gradients as JAX arrays (``None`` stays)."""
        jnp = pytest.importorskip("jax.numpy")
        return ([None if a is None else jnp.asarray(a) for a in part]
                for part in (self.W, self.b, *self.grads()))


@contextlib.contextmanager
def process_group(backend: str = "gloo", store=None, rank: int = 0, world_size: int = 1):
    """This process as ``rank`` of a ``world_size`` process group (an in-memory store by
    default), destroyed on leaving: gloo's world of one, or torch's fake group for one rank
    of a larger world."""
    import torch.distributed as dist
    dist.init_process_group(backend, store=dist.HashStore() if store is None else store,
                            rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def spawn_workers(fn, args, nprocs: int, result, limit: float = 300.0) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes until they end, or until
    ``result`` (a path the workers write atomically when done) exists and they have had
    30 s more: gloo's teardown (``destroy_process_group``) now and then hangs, or aborts,
    in a process whose work is finished, and the result is what the test checks. Fails the
    test after ``limit`` seconds without a result, if a worker raised, or if one died
    before the result existed.

    The workers are forked from multiprocessing's fork server, a fresh single-threaded
    process that imports the workers' modules (torch, the adapters) once for every world
    this process starts: each spawned process would import them anew."""
    import time

    import pytest
    import torch.multiprocessing as mp

    _start_fork_server(fn)
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False,
                             start_method="forkserver")
    deadline, grace = time.monotonic() + limit, None
    while True:
        try:
            if ctx.join(timeout=2):
                return
        except mp.ProcessExitedException:
            # Killed by a signal or exiting non-zero without a Python exception: after the
            # result was written, that is gloo's teardown aborting (SIGABRT); before, an error.
            if not result.exists():
                raise
            for p in ctx.processes:
                p.kill()
            return
        now = time.monotonic()
        if grace is None and result.exists():
            grace = now + 30
        if now > deadline or (grace is not None and now > grace):
            for p in ctx.processes:
                p.kill()
            if grace is None:
                pytest.fail(f"{nprocs} worker processes wrote no result within {limit:.0f} s")
            return


def _start_fork_server(fn) -> None:
    """multiprocessing's fork server, started (once per process) with the modules of ``fn``
    imported (of its function and keywords, for a ``functools.partial``). The server does
    not take this process's ``sys.path``: the folder of those modules is on its PYTHONPATH
    while it starts."""
    import multiprocessing.forkserver

    parts = [getattr(fn, "func", fn), *getattr(fn, "keywords", {}).values()]
    modules = [sys.modules[p.__module__] for p in parts if callable(p)]
    multiprocessing.set_forkserver_preload([m.__name__ for m in modules])
    old = os.environ.get("PYTHONPATH")
    folders = {os.path.dirname(m.__file__) for m in modules}
    os.environ["PYTHONPATH"] = os.pathsep.join(sorted(folders) + ([old] if old else []))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


def from_repository(module: str):
    """A module of the repository outside the installed packages (``benchmarks``), imported
    with the checkout on ``sys.path`` only meanwhile: the tests import gsgd from the
    installed package, never from the checkout."""
    root = str(pathlib.Path(__file__).resolve().parents[1])
    sys.path.insert(0, root)
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(root)
