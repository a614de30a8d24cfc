"""A DDP training run of G-SGD, for the two-process test (spawned processes import this)."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from gsgd_adapters.torch import GSGD

STEPS = 5


def model_and_data():
    torch.manual_seed(0)
    f64 = dict(dtype=torch.float64)  # explicit: independent of the process's default dtype
    model = nn.Sequential(nn.Linear(6, 8, **f64), nn.ReLU(), nn.Linear(8, 5, **f64), nn.ReLU(),
                          nn.Linear(5, 3, **f64))
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(16, 6, generator=g, **f64), torch.randn(16, 3, generator=g, **f64)


def train(model, opt, x, y):
    for _ in range(STEPS):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def worker(rank: int, world: int, init_file: str, out_file: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        model, x, y = model_and_data()
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = GSGD(ddp, lr=0.05, momentum=0.9)
        train(ddp, opt, x[rank::world], y[rank::world])
        if rank == 0:  # written whole, then renamed: the test reads it once it exists
            torch.save(model.state_dict(), out_file + ".part")
            os.replace(out_file + ".part", out_file)
    finally:
        dist.barrier()  # no process tears gloo down while another still talks
        dist.destroy_process_group()
