"""What one optimizer step executes, counted: Python calls and host reads.

- **Python calls** of one eager ``GSGD`` step of the MLP 64-64-64-10 on CPU tensors, as
  ``sys.setprofile`` sees them: the calls into gsgd's own modules (``gsgd_core``,
  ``gsgd_backends``, ``gsgd_adapters``) and all of them (NumPy's and torch's own Python
  wrappers included).
- **Host reads** of one step of the plan that GPU tensors take (every layer on
  ``gsgd_backends.torch.ON_DEVICE``), counted on tensor methods that copy a value to the
  host (``item``, ``tolist``, ``__bool__``, ...): on a GPU each is a synchronisation. It
  runs on the CPU here when there is no GPU (the same code path).
"""

from __future__ import annotations

import collections
import sys

import torch
from torch.overrides import TorchFunctionMode

import gsgd_backends.torch as gbt
import gsgd_core as gc
from gsgd_adapters.torch import GAdam, GSGD, skeleton_init_
from gsgd_backends import gsgd_update_, path_update_

OWN = ("gsgd_core", "gsgd_backends", "gsgd_adapters")
#: Tensor methods that copy a value from the tensor's device to the host.
READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu"}


class HostReads(TorchFunctionMode):
    """Counts reads of tensor values into the host by method (on a GPU: synchronisations)."""

    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.count[name] += 1
        return func(*args, **(kwargs or {}))


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    skeleton_init_(model)
    return model


def python_calls(opt, model) -> tuple[int, int]:
    """(gsgd's own, all) Python calls of one ``opt.step()`` after warm-up steps."""
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    for _ in range(3):
        opt.step()
    calls = collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            calls[frame.f_globals.get("__name__", "").split(".")[0]] += 1

    sys.setprofile(profile)
    try:
        opt.step()
    finally:
        sys.setprofile(None)
    return sum(calls[m] for m in OWN), sum(calls.values())


def _reads_of_one_step(device, hyper: dict | None) -> int:
    """Host reads of the second step (``hyper=None``: G-Adam) of the device plan."""
    chain = gc.Chain.mlp([64, 64, 64, 10])
    g = torch.Generator().manual_seed(0)
    W, b, G, Gb = ([torch.randn(s, generator=g).to(device) for s in shapes]
                   for shapes in ([(64, 64), (64, 64), (10, 64)], [(64,), (64,), (10,)]) * 2)
    kernels = gbt.ON_DEVICE if device.type == "cpu" else gbt.KERNELS
    plan = kernels.plan(chain, W[0])
    rule = gc.adam_rule(1e-3) if hyper is None else None
    state = gc.path_init(chain, rule, W, b) if rule else gc.gsgd_init(chain, W, b)
    reads = HostReads()
    for count in (False, True):
        with reads if count else torch.no_grad():
            if rule:
                path_update_(chain, rule, state, W, b, G, Gb, plan=plan)
            else:
                gsgd_update_(chain, state, W, b, G, Gb, lr=0.01, plan=plan, **hyper)
    return sum(reads.count.values())


def host_reads(device) -> dict[str, int]:
    """Host reads of one step of the device plan (after a first step) per update rule."""
    return {name: _reads_of_one_step(device, hyper) for name, hyper in (
        ("plain", {}), ("momentum 0.9", dict(momentum=0.9)), ("G-Adam", None))}


def counts_table(device) -> str:
    """The counts as a markdown table."""
    rows = []
    for label, make in (("GSGD", lambda m: GSGD(m, lr=0.01)),
                        ("GSGD momentum 0.9", lambda m: GSGD(m, lr=0.01, momentum=0.9)),
                        ("GAdam", lambda m: GAdam(m, lr=1e-3))):
        model = _mlp()
        own, total = python_calls(make(model), model)
        rows.append(f"| {label} | {own} | {total} |")
    reads = host_reads(device)
    where = "on the CPU (no GPU here)" if device.type == "cpu" else f"on {device}"
    return ("Python calls of one eager step, MLP 64-64-64-10, CPU tensors:\n\n"
            "| optimizer | gsgd's own calls | all Python calls |\n|---|---:|---:|\n"
            + "\n".join(rows)
            + f"\n\nHost reads per step of the GPU plan (ON_DEVICE), run {where}: "
            + ", ".join(f"{k} {v}" for k, v in reads.items()) + ".")
