"""``python -m benchmarks.fsdp``: G-SGD and G-Adam under FSDP2 (``fully_shard``) next to SGD
and Adam.

Spawns ``--procs`` CPU processes (gloo, one thread each). Every model is sharded by
``fully_shard`` on each Linear/Conv layer and at the root, once per optimizer; then, for
each optimizer in turn (interleaved, medians over ``--reps`` rounds):

- the optimizer step alone, on gradients held fixed;
- a whole training step (forward, backward with FSDP's reduce-scatter, step), batch 64;
- the payload the step hands to collectives, per process: bytes of every ``all_reduce``
  input, all-gather output and reduce-scatter input while ``step()`` runs, and the same
  for a whole training step.

G-SGD's (and G-Adam's) step sends one vector of ``O(sum of widths)`` numbers (column sums,
skeleton edges, biases); SGD's and Adam's send nothing; FSDP itself moves ``O(m)`` per
training step. Writes ``fsdp.md`` to ``--out``. Run it from the repository root.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from . import threads
from .step_overhead import MODELS  # the same model builders

SIZES = ("MLP 64-256-256-10", "MLP 256-640x3-10", "MLP 1024-2048x3-10", "CNN c=32",
         "CNN c=110")
QUICK = ("MLP 64-256-256-10", "CNN c=32")
OPTIMIZERS = ("SGD", "G-SGD", "SGD m=0.9", "G-SGD m=0.9", "Adam", "G-Adam")
BASELINE = {"G-SGD": "SGD", "G-SGD m=0.9": "SGD m=0.9", "G-Adam": "Adam"}
LR = 1e-4


class Traffic:
    """Bytes handed to collectives by this process while ``counting`` is on."""

    def __init__(self) -> None:
        self.bytes, self.counting = 0, False
        # FSDP2 calls the ``*_single`` collectives; G-SGD's step calls ``all_reduce``.
        for name, arg in (("all_reduce", 0), ("all_gather_single", 0),
                          ("reduce_scatter_single", 1), ("all_gather_into_tensor", 0),
                          ("reduce_scatter_tensor", 1)):
            if hasattr(dist, name):
                self._wrap(name, arg)

    def _wrap(self, name: str, which: int) -> None:
        orig = getattr(dist, name)

        def counted(*args, **kwargs):
            if self.counting:
                t = args[which] if len(args) > which else list(kwargs.values())[which]
                self.bytes += t.numel() * t.element_size()
            return orig(*args, **kwargs)

        setattr(dist, name, counted)

    def measure(self, fn) -> int:
        self.bytes, self.counting = 0, True
        try:
            fn()
        finally:
            self.counting = False
        return self.bytes


def _optimizer(kind: str, model):
    from gsgd_adapters.torch import GSGD, GAdam
    if kind.endswith("Adam"):
        return GAdam(model, lr=LR) if kind == "G-Adam" else torch.optim.Adam(
            model.parameters(), lr=LR, foreach=True)
    momentum = 0.9 if kind.endswith("m=0.9") else 0.0
    if kind.startswith("G-SGD"):
        return GSGD(model, lr=LR, momentum=momentum)
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum, foreach=True)


def _sharded(name: str, mesh):
    from torch.distributed.fsdp import fully_shard
    from gsgd_adapters.torch import skeleton_init_
    build, arg = MODELS[name]
    torch.manual_seed(0)
    model = build(arg)
    skeleton_init_(model)
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batch(name: str, rank: int, batch: int = 64):
    g = torch.Generator().manual_seed(rank)
    shape = (batch, MODELS[name][1][0]) if name.startswith("MLP") else (batch, 3, 16, 16)
    return torch.randn(shape, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _measure(name: str, mesh, rank: int, reps: int, traffic: Traffic) -> dict:
    x, y = _batch(name, rank)
    models = {k: _sharded(name, mesh) for k in OPTIMIZERS}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opts = {k: _optimizer(k, models[k]) for k in OPTIMIZERS}
    loss_fn = nn.CrossEntropyLoss()

    def train_step(k):
        opts[k].zero_grad()
        loss_fn(models[k](x), y).backward()
        opts[k].step()

    for k in OPTIMIZERS:  # gradients for the step-only timing, and a warm-up
        train_step(k)
    grads = {k: [p.grad for p in models[k].parameters()] for k in OPTIMIZERS}
    out = {k: {"step": [], "train": []} for k in OPTIMIZERS}
    for _ in range(reps):
        for k in OPTIMIZERS:
            dist.barrier()
            t0 = time.perf_counter()
            opts[k].step()
            dist.barrier()
            out[k]["step"].append(time.perf_counter() - t0)
    for _ in range(max(3, reps // 3)):
        for k in OPTIMIZERS:
            dist.barrier()
            t0 = time.perf_counter()
            train_step(k)
            dist.barrier()
            out[k]["train"].append(time.perf_counter() - t0)
    for k in OPTIMIZERS:
        for p, g in zip(models[k].parameters(), grads[k]):
            p.grad = g
        out[k]["step_bytes"] = traffic.measure(opts[k].step)
        out[k]["train_bytes"] = traffic.measure(lambda k=k: train_step(k))
        out[k]["step"] = statistics.median(out[k]["step"])
        out[k]["train"] = statistics.median(out[k]["train"])
    m = sum(p.numel() for p in models["SGD"].parameters())
    return dict(weights=m, **out)


def worker(rank: int, world: int, init_file: str, result: str, names, reps: int) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    try:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world,))
        traffic = Traffic()
        rows = {}
        it = names
        if rank == 0:
            from tqdm import tqdm
            it = tqdm(names, desc=f"FSDP2 on {world} processes", unit="model")
        for name in it:
            rows[name] = _measure(name, mesh, rank, reps, traffic)
        if rank == 0:  # written whole, then renamed: the parent waits for it
            torch.save(rows, result + ".part")
            os.replace(result + ".part", result)
    finally:
        dist.barrier()  # no process tears gloo down while another still talks
        dist.destroy_process_group()


def _kb(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1024 ** 2 else f"{n / 1024 ** 2:.1f} MiB"


def table(rows: dict, world: int) -> str:
    lines = [f"FSDP2 on {world} CPU processes (gloo, 1 thread each), float32, batch 64 per "
             "process; medians of interleaved runs. Step: `optimizer.step()` on fixed "
             "gradients; train: forward + backward + step; ratios against the baseline "
             "(G-SGD: SGD with the same momentum; G-Adam: Adam(foreach)). Bytes: payload "
             "this process hands to collectives.", "",
             "| model | weights | optimizer | step ms | step ratio | train ms "
             "| train ratio | step bytes | train-step bytes |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        for k in OPTIMIZERS:
            base = r[BASELINE.get(k, k)]
            lines.append(
                f"| {name} | {r['weights']:,} | {k} | {r[k]['step'] * 1e3:.2f} "
                f"| {r[k]['step'] / base['step']:.2f} | {r[k]['train'] * 1e3:.1f} "
                f"| {r[k]['train'] / base['train']:.2f} | {_kb(r[k]['step_bytes'])} "
                f"| {_kb(r[k]['train_bytes'])} |")
    return "\n".join(lines)


def _join(ctx, result: str) -> None:
    """Wait for the workers; once ``result`` exists, give them 30 s to end and then stop
    them (gloo's ``destroy_process_group`` now and then hangs after the work is done)."""
    grace = None
    while not ctx.join(timeout=2):
        if grace is None and os.path.exists(result):
            grace = time.monotonic() + 30
        if grace is not None and time.monotonic() > grace:
            for p in ctx.processes:
                p.kill()
            return


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fsdp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--reps", type=int, default=30, help="rounds per timing (default 30)")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    args = parser.parse_args(argv)
    if not dist.is_available():
        print("torch.distributed is not available in this build of torch", file=sys.stderr)
        return 1
    names = QUICK if args.quick else SIZES
    reps = min(args.reps, 5) if args.quick else args.reps
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "rows.pt")
        ctx = mp.start_processes(worker, args=(args.procs, os.path.join(tmp, "init"), result,
                                               names, reps), nprocs=args.procs, join=False,
                                 start_method="spawn")
        _join(ctx, result)
        rows = torch.load(result, weights_only=True)
    text = table(rows, args.procs)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fsdp.md").write_text(f"# G-SGD under FSDP2\n\n{threads.measured_on()}\n\n"
                                      f"{text}\n")
    print(f"wrote {args.out / 'fsdp.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
