"""DDP training runs of G-SGD and G-Adam, for tests/test_torch_ddp.py (spawned processes
import this; the test process trains the same model on one process to compare)."""

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from _gloo import gloo_worker
from gsgd_adapters.torch import GAdam, GSGD

STEPS = 5


def model_and_data():
    torch.manual_seed(0)
    f64 = dict(dtype=torch.float64)  # explicit: independent of the process's default dtype
    model = nn.Sequential(nn.Linear(6, 8, **f64), nn.ReLU(), nn.Linear(8, 5, **f64), nn.ReLU(),
                          nn.Linear(5, 3, **f64))
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(16, 6, generator=g, **f64), torch.randn(16, 3, generator=g, **f64)


def train(model, opt, x, y, micro: int = 1, no_sync=None, edit=None, set_to_none=True):
    """``STEPS`` steps of the mean squared error over ``micro`` micro-batches, all but the
    last under ``no_sync`` (every one, if ``micro`` is 1 and ``no_sync`` given);
    ``edit(i)`` runs after micro-batch ``i``'s backward pass."""
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=set_to_none)
        for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            quiet = no_sync is not None and (i < micro - 1 or micro == 1)
            with no_sync() if quiet else contextlib.nullcontext():
                (((model(xs) - ys) ** 2).mean() / micro).backward()
            if edit is not None:
                edit(i)
        opt.step()


def _edit_on(rank: int, model):
    """An in-place change of the middle layer's gradient on ``rank`` after the first
    micro-batch (values kept: it multiplies by one), which that process's record sees."""
    def edit(i):
        if i == 0 and dist.get_rank() == rank:
            model[2].weight.grad.mul_(1.0)
    return edit


#: name -> (DDP's keyword arguments, optimizer, train's keyword arguments given the model
#: and the DDP module)
SCENARIOS = {
    "plain": ({}, GSGD, lambda m, d: {}),
    "gadam": ({}, GAdam, lambda m, d: {}),
    "accumulate": ({}, GSGD, lambda m, d: dict(micro=2, no_sync=d.no_sync)),
    "bucket_view": (dict(gradient_as_bucket_view=True), GSGD,
                    lambda m, d: dict(micro=2, no_sync=d.no_sync)),
    "bucket_view_kept": (dict(gradient_as_bucket_view=True), GSGD,
                         lambda m, d: dict(micro=2, no_sync=d.no_sync, set_to_none=False)),
    "find_unused": (dict(find_unused_parameters=True), GSGD, lambda m, d: {}),
    "comm_hook": ({}, GSGD, lambda m, d: {}),
    "edited_on_one": ({}, GSGD, lambda m, d: dict(micro=2, no_sync=d.no_sync,
                                                  edit=_edit_on(1, m))),
    "no_sync_only": ({}, GSGD, lambda m, d: dict(no_sync=d.no_sync)),
}


def optimizer(make, model):
    return make(model, lr=0.05 if make is GSGD else 0.01, **(
        dict(momentum=0.9) if make is GSGD else {}))


def runs(rank: int, world: int) -> dict:
    """Every scenario on this process's share of the batch: each process's weights and
    column sums' counts."""
    results = {}
    for name, (ddp_kwargs, make, train_kwargs) in SCENARIOS.items():
        model, x, y = model_and_data()
        ddp = nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
        if name == "comm_hook":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        opt = optimizer(make, ddp)
        train(ddp, opt, x[rank::world], y[rank::world], **train_kwargs(model, ddp))
        counts = [None] * world
        dist.all_gather_object(counts, dict(opt.describe().column_sums))
        states = [None] * world
        dist.all_gather_object(states, {k: v.clone() for k, v in model.state_dict().items()})
        results[name] = dict(states=states, counts=counts)
    return results


worker = functools.partial(gloo_worker, run=runs, timeout=60)
