"""The fused G-SGD step on a CUDA device against torch's own optimizers: time and launches.

``python -m benchmarks.fused_step`` (a CUDA device and triton needed) times, in float32,
for models of :mod:`benchmarks.step_overhead`:

- the optimizer step alone (every gradient set once): ``SGD``, ``SGD(momentum=0.9)`` and
  ``Adam``, each ``foreach`` and ``fused``, against ``GSGD``/``GAdam`` fused (one plan for
  every chain: three launches, no host read) and per layer (``fused=False``), with the
  kernel launches of one step counted by ``torch.profiler``;
- a whole training step at batch 128 (``zero_grad``, forward, backward, step): ``SGD`` against
  ``GSGD`` fused with the column sums taken in the backward pass, fused reading ``W * grad``
  in the step instead, and per layer;
- ResNet-18 with batch norm (PSI-SGD(M) on its convolutions): ``SGD`` against ``GSGD``;
- with ``--graph``: the fused step of every chain (:func:`gsgd_backends.fused.fused_step_`)
  eagerly and replayed from one captured CUDA graph.

Each figure is the median of interleaved rounds of ``--steps`` steps between two CUDA
events. Writes the Markdown table to ``<out>/fused_step.md``.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import warnings

import torch
import torch.nn as nn

import gsgd_core as gc
from gsgd_adapters.torch import GAdam, GSGD, SkeletonWarning, discover, skeleton_init_

from .resnet import resnet18
from .step_overhead import MODELS, machine

LR = 1e-4
DEFAULT_MODELS = ("MLP 64-64-64-10", "MLP 256-640x3-10", "MLP 1024-2048x3-10", "CNN c=32",
                  "CNN c=110")


def _model(name, device):
    build, arg = MODELS[name] if name in MODELS else (lambda _: resnet18(), None)
    torch.manual_seed(0)
    model = build(arg).to(device)
    skeleton_init_(model)
    return model


def _with_grads(model):
    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return model


def _optimizer(kind: str, model, **kw):
    """``kind`` is ``"sgd"``/``"adam"`` (torch's, with ``foreach`` or ``fused`` in ``kw``)
    or ``"gsgd"``/``"gadam"``; ``None`` where this build of the library refuses it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkeletonWarning)
        if kind == "sgd":
            return torch.optim.SGD(model.parameters(), lr=LR, **kw)
        if kind == "adam":
            return torch.optim.Adam(model.parameters(), lr=LR, **kw)
        try:
            return (GSGD if kind == "gsgd" else GAdam)(model, lr=LR, **kw)
        except (TypeError, ValueError) as exc:
            print(f"skipped {kind} {kw}: {exc}", flush=True)
            return None


def _step_variants(name, device) -> dict:
    """Label -> a step (gradients set once, no backward pass)."""
    out = {}
    for tag, kind, ours, kw in (("", "sgd", "gsgd", {}),
                                (", momentum 0.9", "sgd", "gsgd", dict(momentum=0.9)),
                                (" (Adam)", "adam", "gadam", {})):
        base = "SGD" if kind == "sgd" else "Adam"
        for impl in ("foreach", "fused"):
            out[f"{base}({impl}){tag}"] = _optimizer(kind, _with_grads(_model(name, device)),
                                                     **kw, **{impl: True})
        label = "G-SGD" if ours == "gsgd" else "G-Adam"
        for fused in (True, False):
            out[f"{label} {'fused' if fused else 'per layer'}{tag}"] = _optimizer(
                ours, _with_grads(_model(name, device)), fused=fused, **kw)
    return {k: o.step for k, o in out.items() if o is not None}


def _train_variants(name, device, batch=128) -> dict:
    """Label -> a whole training step at ``batch``."""
    build, arg = MODELS[name]
    x = (torch.randn(batch, arg[0], device=device) if name.startswith("MLP")
         else torch.randn(batch, 3, 16, 16, device=device))
    y = torch.randint(0, 10, (batch,), device=device)
    made = {"SGD(foreach)": ("sgd", dict(foreach=True)),
            "G-SGD fused, sums from the backward pass": ("gsgd", dict(fused=True)),
            "G-SGD fused, sums from W*grad": ("gsgd", dict(fused=True, backward_sums=False)),
            "G-SGD per layer": ("gsgd", dict(fused=False))}
    out = {}
    for label, (kind, kw) in made.items():
        model = _model(name, device)
        opt = _optimizer(kind, model, **kw)
        if opt is None:
            continue

        def step(model=model, opt=opt):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        out[label] = step
    return out


def _fused_chains(model):
    """The fused step of every chain of ``model`` (a closure, states made once), in the
    units of the He skeleton as ``GSGD``'s default ``skeleton="he"``."""
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
        fused.fused_step_(plan, W, b, G, Gb, lr, states, momentum=0.9, found_inf=found_inf)
    return step


def _graph_variants(name, device) -> dict:
    eager = _fused_chains(_with_grads(_model(name, device)))
    captured = _fused_chains(_with_grads(_model(name, device)))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        captured()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured()
    return {"fused_step_, momentum 0.9": eager, "the same, CUDA graph replay": graph.replay}


def _launches(step) -> int:
    """CUDA kernels and copies one call of ``step`` launches (after a warm-up)."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _timed(fns: dict, steps: int, rounds: int) -> dict:
    """Median milliseconds per call of each function over interleaved rounds."""
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


def _rows(what, name, fns, args, count: bool) -> list[str]:
    ms = _timed(fns, args.steps, args.rounds)
    weights = sum(p.numel() for p in _model(name, "cuda").parameters())
    base = next(iter(ms))
    lines = []
    for k, t in ms.items():
        if k.startswith(("SGD", "Adam")) and "(foreach)" in k:
            base = k  # each group's ratios are to its own foreach baseline
        launches = _launches(fns[k]) if count else ""
        lines.append(f"| {what} | {name} | {weights:,} | {k} | {t:.3f} | "
                     f"{t / ms[base]:.2f}x | {launches} |")
    print("\n".join(lines), flush=True)
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fused_step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=sorted(MODELS))
    ap.add_argument("--train", nargs="*", default=("CNN c=32", "MLP 1024-2048x3-10"),
                    choices=sorted(MODELS), help="models of the training-step rows")
    ap.add_argument("--no-resnet", action="store_true", help="skip the PSI-SGD rows")
    ap.add_argument("--graph", action="store_true",
                    help="only the fused step against its CUDA-graph replay")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the fused step's benchmark needs a CUDA device")
    device = torch.device("cuda")
    lines = [f"Measured on {machine(device)}, torch {torch.__version__}. Median ms per call "
             f"of {args.rounds} interleaved rounds of {args.steps} calls, float32.", "",
             "| what | model | weights | variant | ms | ratio | launches |",
             "|---|---|---:|---|---:|---:|---:|"]
    for name in args.models:
        fns = _graph_variants(name, device) if args.graph else _step_variants(name, device)
        lines += _rows("step", name, fns, args, count=not args.graph)
    if not args.graph:
        for name in args.train:
            lines += _rows("train step, batch 128", name, _train_variants(name, device),
                           args, count=False)
        if not args.no_resnet:
            fns = {k: o.step for k, o in (
                ("SGD(foreach)", _optimizer("sgd", _with_grads(_model("resnet", device)),
                                            foreach=True)),
                ("PSI-SGD fused (GSGD)", _optimizer("gsgd", _with_grads(_model("resnet", device)),
                                                    fused=True)),
                ("PSI-SGD per layer", _optimizer("gsgd", _with_grads(_model("resnet", device)),
                                                 fused=False))) if o is not None}
            lines += _rows("step", "ResNet-18 (BN: PSI)", fns, args, count=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / ("fused_graph.md" if args.graph else "fused_step.md")).write_text(
        "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
