"""The fused G-SGD step on a CUDA device against torch's SGD: step time and kernel launches.

``python -m benchmarks.fused_step`` (a CUDA device and triton needed) times, for each model
of :mod:`benchmarks.step_overhead`, in float32 with every gradient set once:

- ``SGD(foreach=True)`` and ``SGD(fused=True)``, without and with momentum 0.9;
- :func:`gsgd_backends.fused.fused_step_` over every chain of the model (three launches
  whatever the depth), without and with momentum, with a device learning rate and
  GradScaler's ``found_inf`` (so nothing is read back to the host), eagerly and replayed
  from a captured CUDA graph;
- ``GSGD`` (the per-layer step) for reference.

Each figure is the median of interleaved rounds of ``--steps`` steps between two CUDA
events; kernel launches per step are counted by ``torch.profiler``. Writes a Markdown table
to ``<out>/fused_step.md``.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import warnings

import torch

import gsgd_core as gc
from gsgd_adapters.torch import GSGD, SkeletonWarning, discover, skeleton_init_

from .step_overhead import MODELS, machine

LR = 1e-4
DEFAULT_MODELS = ("MLP 64-64-64-10", "MLP 256-640x3-10", "MLP 1024-2048x3-10", "CNN c=32",
                  "CNN c=110")


def _model(name, device):
    build, arg = MODELS[name]
    torch.manual_seed(0)
    model = build(arg).to(device)
    skeleton_init_(model)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    return model


def _fused(model, momentum: float):
    """The fused step of every chain of ``model`` (a closure), its states made once: the
    chains in the units of the He skeleton, as ``GSGD``'s default ``skeleton="he"``."""
    from gsgd_backends import fused
    from gsgd_backends.torch import ON_DEVICE

    found = discover(model).chains
    chains = [c.chain.with_skeleton_scale(c.chain.he_skeleton_scale()) for c in found]
    W = [[m.weight for m in c.modules] for c in found]
    b = [[m.bias for m in c.modules] for c in found]
    G = [[w.grad for w in ws] for ws in W]
    Gb = [[None if x is None else x.grad for x in bs] for bs in b]
    plan = fused.FusedPlan([ON_DEVICE.plan(c, ws[0]) for c, ws in zip(chains, W)])
    states = [gc.gsgd_init(c, ws, bs) for c, ws, bs in zip(chains, W, b)]
    lr = torch.tensor(LR, device=W[0][0].device)
    found_inf = torch.zeros(1, device=W[0][0].device)

    def step():
        fused.fused_step_(plan, W, b, G, Gb, lr, states, momentum=momentum,
                          found_inf=found_inf)
    return step


def _graph(step):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _variants(name, device) -> dict:
    out = {}
    for momentum in (0.0, 0.9):
        tag = "" if not momentum else ", momentum 0.9"
        for kind in ("foreach", "fused"):
            model = _model(name, device)
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum,
                                  **{kind: True})
            out[f"SGD({kind}){tag}"] = opt.step
        out[f"fused G-SGD{tag}"] = _fused(_model(name, device), momentum)
        out[f"fused G-SGD{tag}, CUDA graph"] = _graph(_fused(_model(name, device), momentum))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SkeletonWarning)
            opt = GSGD(_model(name, device), lr=LR, momentum=momentum)
        out[f"GSGD (per layer){tag}"] = opt.step
    return out


def _launches(step) -> int:
    """CUDA kernels and copies one call of ``step`` launches (after a warm-up)."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _timed(fns: dict, steps: int, rounds: int) -> dict:
    """Median milliseconds per step of each function over interleaved rounds."""
    for k, f in fns.items():  # a failing launch named here, not at a later variant's sync
        f()
        try:
            torch.cuda.synchronize()
        except RuntimeError as exc:
            raise RuntimeError(f"{k}: {exc}") from exc
    times = {k: [] for k in fns}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        for k, f in fns.items():
            start.record()
            for _ in range(steps):
                f()
            end.record()
            end.synchronize()
            times[k].append(start.elapsed_time(end) / steps)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fused_step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=sorted(MODELS))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the fused step's benchmark needs a CUDA device")
    device = torch.device("cuda")
    lines = [f"Measured on {machine(device)}, torch {torch.__version__}. Median ms per step "
             f"of {args.rounds} interleaved rounds of {args.steps} steps, float32.", "",
             "| model | weights | step | ms | x SGD(foreach) | launches |",
             "|---|---:|---|---:|---:|---:|"]
    for name in args.models:
        fns = _variants(name, device)
        ms = _timed(fns, args.steps, args.rounds)
        weights = sum(p.numel() for p in _model(name, device).parameters())
        for k, t in ms.items():
            base = ms["SGD(foreach)" + (", momentum 0.9" if "momentum" in k else "")]
            count = "" if "graph" in k else _launches(fns[k])
            lines.append(f"| {name} | {weights:,} | {k} | {t:.3f} | {t / base:.2f}x | "
                         f"{count} |")
        print("\n".join(lines[-len(ms):]), flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fused_step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
