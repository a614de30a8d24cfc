"""``python -m benchmarks.step_overhead``: what a G-SGD (and G-Adam) step costs next to SGD.

Optimizer-step time of G-SGD against each library's own SGD, for MLPs and CNNs from 1e4 to
1e7 weights, every optimizer stepping its own copy in turn (interleaved) and the median of
many steps taken; then the end-to-end training step (forward + backward + step) at batch 128.
Prints a table and writes ``step_overhead.md`` and ``step_overhead.png`` (ratio against size)
to ``--out``.

- torch (CPU float32, or CUDA when available): ``torch.optim.SGD(foreach=True)`` against
  ``GSGD`` (eager fast path), ``GSGD(compile=True)``, and both with momentum 0.9 against
  ``SGD(momentum=0.9, foreach=True)``; ``GAdam`` (eager and compiled) against
  ``torch.optim.Adam(foreach=True)``;
  ResNet-18 with batch norm, where ``GSGD`` is PSI-SGD(M) on every conv weight. Every step
  follows a real backward pass (untimed) on a batch of 32, so that G-SGD's steps take their
  column sums from it (DESIGN §12); beside them, ``GSGD(backward_sums=False)``, whose step
  reads them from ``W * grad`` (the "sums from W*grad" rows).
- NumPy: ``w -= lr * g`` and a preallocated in-place SGD against ``gsgd_step_``, on
  gradients held fixed (no backward pass: the step reads ``W * grad``).
- CuPy (GPU only): ``w -= lr * g`` against ``gsgd_step_``, likewise.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import statistics
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from tqdm import tqdm

import gsgd_backends as gb
import gsgd_core as gc
from gsgd_adapters.torch import GSGD, GAdam, SkeletonWarning, skeleton_init_

from . import threads
from .resnet import resnet18
from .step_counts import counts_table

LR = 1e-4


def mlp(widths):
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
    return nn.Sequential(*layers)


def cnn(c):
    """conv(3->c) pool conv(c->2c) pool conv(2c->4c) flatten linear(4c*16 -> 10), 16x16 in."""
    return nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(2 * c, 4 * c, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * c * 16, 10))


MODELS = {  # name -> (builder, argument); sizes span 1e4..1e7 weights
    "MLP 64-64-64-10": (mlp, (64, 64, 64, 10)),
    "MLP 64-256-256-10": (mlp, (64, 256, 256, 10)),
    "MLP 256-640x3-10": (mlp, (256, 640, 640, 640, 10)),
    "MLP 1024-2048x3-10": (mlp, (1024, 2048, 2048, 2048, 10)),
    "CNN c=8": (cnn, 8),
    "CNN c=32": (cnn, 32),
    "CNN c=110": (cnn, 110),
    "CNN c=340": (cnn, 340),
}
QUICK = ("MLP 64-64-64-10", "MLP 64-256-256-10", "CNN c=8", "CNN c=32")
E2E = ("CNN c=32", "CNN c=110", "MLP 1024-2048x3-10", "CNN c=340")


@dataclass
class Row:
    library: str
    model: str
    weights: int
    variants: dict  # G-SGD variant -> (baseline, baseline seconds, G-SGD seconds)

    def ratios(self) -> dict:
        """Variant -> step time over its baseline's step time."""
        return {k: sec / base for k, (_, base, sec) in self.variants.items()}


def interleaved(fns: dict, reps: int) -> dict:
    """Median seconds of each function, run in turn ``reps`` times after one warm-up each; a
    function that returns a number returns the seconds it timed itself (a step after an
    untimed backward pass)."""
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            own = f()
            times[k].append(time.perf_counter() - t0 if own is None else own)
    return {k: statistics.median(v) for k, v in times.items()}


def _synced(f, sync):
    """``f`` then ``sync``, returning nothing, so that :func:`interleaved` times both."""
    def g():
        f()
        sync()
    return g


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _stepper(opt, device, backward=None):
    """``opt``'s step, timed alone (the seconds returned); ``backward`` runs before it,
    untimed."""
    def f():
        if backward is not None:
            backward()
            _sync(device)
        t0 = time.perf_counter()
        opt.step()
        _sync(device)
        return time.perf_counter() - t0
    return f


def _batch(name, device, batch=32):
    """A batch of random inputs and labels for the model ``name``."""
    build, arg = MODELS[name]
    mlp_ = name.startswith("MLP")
    shape = (batch, arg[0]) if mlp_ else (batch, 3, 16, 16)
    return (torch.randn(shape, device=device),
            torch.randint(0, arg[-1] if mlp_ else 10, (batch,), device=device))


def _copies(make, kinds, device):
    """One model per kind, all with the same weights (skeleton initialised, so that
    G-SGD trains stably while it is timed)."""
    torch.manual_seed(0)
    base = make().to(device)
    skeleton_init_(base)
    copies = {k: make().to(device) for k in kinds}
    for m in copies.values():
        m.load_state_dict(base.state_dict())
    return copies, sum(p.numel() for p in base.parameters())


def _backward(model, opt, batch):
    """Clear the gradients and take a real backward pass on ``batch``: a step's gradients
    and, for G-SGD, its column sums."""
    x, y = batch

    def f():
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
    return f


SGD, SGDM = "SGD(foreach)", "SGD(momentum=0.9, foreach)"
#: The variant whose column sums are read from ``W * grad`` in the step.
PRODUCT = "G-SGD, sums from W*grad"


def _variants(times: dict, spec) -> dict:
    """Variant -> (baseline, baseline seconds, seconds) for each ``(variant, baseline,
    baseline key, key)`` of ``spec`` whose optimizer ran (compiled ones only on request)."""
    return {v: (base, times[bk], times[k]) for v, base, bk, k in spec if k in times}


def torch_rows(name, device, reps, compile_):
    build, arg = MODELS[name]
    kinds = ("sgd", "gsgd", "product", "sgdm", "gsgdm", "adam", "gadam") + (
        ("gsgdc", "gsgdmc", "gadamc") if compile_ else ())
    copies, m = _copies(lambda: build(arg), kinds, device)
    opts = {"sgd": torch.optim.SGD(copies["sgd"].parameters(), lr=LR, foreach=True),
            "gsgd": GSGD(copies["gsgd"], lr=LR),
            "product": GSGD(copies["product"], lr=LR, backward_sums=False),
            "sgdm": torch.optim.SGD(copies["sgdm"].parameters(), lr=LR, momentum=0.9,
                                    foreach=True),
            "gsgdm": GSGD(copies["gsgdm"], lr=LR, momentum=0.9),
            "adam": torch.optim.Adam(copies["adam"].parameters(), lr=LR, foreach=True),
            "gadam": GAdam(copies["gadam"], lr=LR)}
    if compile_:
        opts["gsgdc"] = GSGD(copies["gsgdc"], lr=LR, compile=True)
        opts["gsgdmc"] = GSGD(copies["gsgdmc"], lr=LR, momentum=0.9, compile=True)
        opts["gadamc"] = GAdam(copies["gadamc"], lr=LR, compile=True)
    batch = _batch(name, device)
    steppers = {k: _stepper(o, device, _backward(copies[k], o, batch)) for k, o in opts.items()}
    # Plain and momentum steps interleave within their own group: each ratio compares
    # optimizers that ran in turn, on equally warm caches.
    t = {}
    for group in (("sgd", "gsgd", "gsgdc", "product"), ("sgdm", "gsgdm", "gsgdmc"),
                  ("adam", "gadam", "gadamc")):
        t.update(interleaved({k: steppers[k] for k in group if k in opts}, reps))
    return Row(f"torch {device.type}", name, m, _variants(t, [
        ("G-SGD", SGD, "sgd", "gsgd"), ("G-SGD compiled", SGD, "sgd", "gsgdc"),
        (PRODUCT, SGD, "sgd", "product"),
        ("momentum 0.9", SGDM, "sgdm", "gsgdm"),
        ("momentum 0.9 compiled", SGDM, "sgdm", "gsgdmc"),
        ("G-Adam", "Adam(foreach)", "adam", "gadam"),
        ("G-Adam compiled", "Adam(foreach)", "adam", "gadamc")]))


def psi_row(device, reps, compile_):
    """ResNet-18 with batch norm: ``GSGD`` (PSI on every conv weight, SGD's rule on the rest)
    against SGD(foreach), plain and with momentum 0.9, eager and compiled, interleaved; the
    parameters that ``GSGD`` gives SGD's rule take ``foreach=True`` as the baseline does (on
    the CPU, torch's default is one tensor at a time)."""
    kinds = ("sgd", "psi", "sgdm", "psim") + (("psic", "psimc") if compile_ else ())
    copies, m = _copies(resnet18, kinds, device)
    # gradients held fixed: PSI-SGD(M) reads no column sums, so no backward pass is timed
    torch.manual_seed(1)
    grads = [torch.randn_like(p) * 1e-3 for p in copies["sgd"].parameters()]
    for model in copies.values():
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
    opts = {"sgd": torch.optim.SGD(copies["sgd"].parameters(), lr=LR, foreach=True),
            "psi": GSGD(copies["psi"], lr=LR, foreach=True),
            "sgdm": torch.optim.SGD(copies["sgdm"].parameters(), lr=LR, momentum=0.9,
                                    foreach=True),
            "psim": GSGD(copies["psim"], lr=LR, momentum=0.9, foreach=True)}
    if compile_:
        opts["psic"] = GSGD(copies["psic"], lr=LR, foreach=True, compile=True)
        opts["psimc"] = GSGD(copies["psimc"], lr=LR, momentum=0.9, foreach=True, compile=True)
    t = {}
    for group in (("sgd", "psi", "psic"), ("sgdm", "psim", "psimc")):
        t.update(interleaved({k: _stepper(opts[k], device) for k in group if k in opts}, reps))
    return Row(f"torch {device.type}", PSI_MODEL, m, _variants(t, [
        ("PSI-SGD (GSGD, bn='psi')", SGD, "sgd", "psi"),
        ("PSI-SGD compiled", SGD, "sgd", "psic"), ("PSI-SGDM 0.9", SGDM, "sgdm", "psim"),
        ("PSI-SGDM 0.9 compiled", SGDM, "sgdm", "psimc")]))


PSI_MODEL = "ResNet-18 (BN: PSI)"


def _chain_arrays(name, xp, dtype):
    """The torch model's chain and random weights/gradients as arrays of ``xp``."""
    build, arg = MODELS[name]
    model = build(arg)
    layers = [mod for mod in model if isinstance(mod, (nn.Linear, nn.Conv2d))]
    shapes = [tuple(mod.weight.shape) for mod in layers]
    if name.startswith("CNN"):
        shapes[-1] = (shapes[-1][0], shapes[-2][0] * 16)  # flatten of 4x4 positions
    chain = gc.Chain.from_shapes(shapes, bias=True)
    rng = np.random.default_rng(0)
    arr = lambda a: xp.asarray(a.astype(dtype))  # noqa: E731
    W = [arr(rng.standard_normal(s) * 0.05) for s in shapes]
    b = [arr(np.zeros(s[0])) for s in shapes]
    G = [arr(rng.standard_normal(s) * 1e-3) for s in shapes]
    Gb = [arr(rng.standard_normal(s[0]) * 1e-3) for s in shapes]
    return chain, W, b, G, Gb


def array_rows(name, xp, reps):
    chain, W, b, G, Gb = _chain_arrays(name, xp, np.float32)
    W0, b0 = [w.copy() for w in W], [x.copy() for x in b]
    bufs = [xp.empty_like(w) for w in W0 + b0]

    def sgd():
        for p, g in zip(W0 + b0, G + Gb):
            p -= LR * g

    def sgd_inplace():
        for p, g, buf in zip(W0 + b0, G + Gb, bufs):
            xp.multiply(g, LR, out=buf)
            xp.subtract(p, buf, out=p)

    def gsgd():
        gb.gsgd_step_(chain, W, b, G, Gb, LR)

    fns = {"sgd": sgd, "sgd_inplace": sgd_inplace, "gsgd": gsgd}
    if xp is not np:  # a GPU step is timed to its end, not to its launch
        fns = {k: _synced(f, xp.cuda.get_current_stream().synchronize) for k, f in fns.items()}
    t = interleaved(fns, reps)
    variants = {"G-SGD": ("w -= lr*g", t["sgd"], t["gsgd"])}
    if xp is np:
        variants["G-SGD vs in-place SGD"] = ("preallocated in-place SGD", t["sgd_inplace"],
                                             t["gsgd"])
    m = sum(int(np.prod(w.shape)) for w in W + b)
    return Row(xp.__name__, name, m, variants)


def _twice(kinds) -> tuple:
    """Each kind twice (``k`` and ``k'``): a whole training step's time depends on where its
    model's tensors landed in memory by several percent, so each kind is timed on two
    copies and the two medians averaged (:func:`_mean_of_twins`)."""
    return tuple(k + t for k in kinds for t in ("", "'"))


def _mean_of_twins(times: dict) -> dict:
    return {k: (v + times[k + "'"]) / 2 for k, v in times.items() if not k.endswith("'")}


def e2e_row(name, device, reps, compile_, batch=128):
    build, arg = MODELS[name]
    kinds = _twice(("sgd", "gsgd", "gsgdc") if compile_ else ("sgd", "gsgd"))
    models, m = _copies(lambda: build(arg), kinds, device)
    opts = {k: torch.optim.SGD(models[k].parameters(), lr=LR, foreach=True)
            if k.startswith("sgd") else GSGD(models[k], lr=LR, compile=k.startswith("gsgdc"))
            for k in kinds}
    data = _batch(name, device, batch)

    def train_step(k):
        backward = _backward(models[k], opts[k], data)

        def f():
            backward()
            opts[k].step()
            _sync(device)
        return f

    t = _mean_of_twins(interleaved({k: train_step(k) for k in models}, reps))
    variants = {"G-SGD": ("SGD(foreach)", t["sgd"], t["gsgd"])}
    if compile_:
        variants["G-SGD compiled"] = ("SGD(foreach)", t["sgd"], t["gsgdc"])
    return Row(f"torch {device.type}", f"{name} train step, batch {batch}", m, variants)


def hooks_row(name, device, reps, batch=128):
    """What collecting the column sums costs the backward pass: ``zero_grad``, forward and
    backward of a model whose optimizer collects them (``GSGD``) against the same model
    whose optimizer does not (``GSGD(backward_sums=False)``), interleaved, two copies each."""
    build, arg = MODELS[name]
    models, m = _copies(lambda: build(arg), _twice(("plain", "hooked")), device)
    opts = {k: GSGD(models[k], lr=LR, backward_sums=k.startswith("hooked")) for k in models}
    data = _batch(name, device, batch)

    def backward(k):
        f = _backward(models[k], opts[k], data)

        def timed():
            f()
            _sync(device)
        return timed

    t = _mean_of_twins(interleaved({k: backward(k) for k in models}, reps))
    return Row(f"torch {device.type}", f"{name} forward + backward, batch {batch}", m,
               {"collecting the sums": ("no hooks", t["plain"], t["hooked"])})


def table(rows) -> str:
    lines = ["| library | model | parameters | baseline | baseline ms | G-SGD variant | ms "
             "| ratio |", "|---|---|---:|---|---:|---|---:|---:|"]
    for r in rows:
        for variant, (baseline, base, sec) in r.variants.items():
            lines.append(f"| {r.library} | {r.model} | {r.weights:,} | {baseline} | "
                         f"{1e3 * base:.3f} | {variant} | {1e3 * sec:.3f} | {sec / base:.2f}x |")
    return "\n".join(lines)


def plot(rows, path) -> None:
    """Ratio against size: one colour per library and variant, MLPs solid, CNNs dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.8))
    series: dict = {}
    for r in rows:
        if "train step" in r.model or "forward + backward" in r.model:
            continue
        for variant, ratio in r.ratios().items():
            key = (f"{r.library}: {variant}", r.model.split()[0])
            series.setdefault(key, []).append((r.weights, ratio))
    keys = sorted({k for k, _ in series})
    palette = plt.get_cmap("tab20").colors  # a full run plots 11 library/variant pairs
    colours = {k: palette[i % len(palette)] for i, k in enumerate(keys)}
    for (key, kind), pts in sorted(series.items()):
        pts.sort()
        product = PRODUCT in key  # the step that reads W * grad: drawn as the reference
        ax.plot([p[0] for p in pts], [p[1] for p in pts],
                color="grey" if product else colours[key],
                ls=":" if product else "-" if kind == "MLP" else "--",
                marker="o" if kind == "MLP" else "s", ms=3 if product else 4,
                label=f"{key} ({kind})")
    ax.axhline(2.5, color="grey", ls="--", lw=1, label="target 2.5x")
    ax.set(xscale="log", yscale="log", xlabel="parameters", ylabel="step time / SGD step time",
           title="G-SGD optimizer-step overhead")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine(device) -> str:
    cpu = f"{threads.cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name()} / {cpu}"
    return cpu


def busy_warning(n_threads: int, load: float | None) -> str:
    """A loud warning (printed) when the machine lacks the idle cores the timings need: the
    load average before the run (``load``; afterwards it holds the run's own work) leaves
    fewer than ``n_threads`` cores free, and a ratio measured then says more about the
    neighbours than about the optimizer."""
    if load is None or (os.cpu_count() or 1) - load >= n_threads - 0.25:
        return ""
    text = (f"WARNING: the machine is busy: load average {load:.2f} on {os.cpu_count()} cores "
            f"leaves fewer than the {n_threads} idle cores these timings need; ratios measured "
            "under load are not comparable with docs/step_overhead.md. Measure on an idle "
            "machine.")
    print(text, file=sys.stderr, flush=True)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.step_overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small models, few steps")
    ap.add_argument("--out", default="results")
    ap.add_argument("--threads", type=int, default=2,
                    help="torch CPU threads (default 2: the timings in docs/ used 2)")
    ap.add_argument("--no-compile", action="store_true", help="skip GSGD(compile=True)")
    ap.add_argument("--only", nargs="+", metavar="MODEL",
                    help=f"only these models (names as in the table, e.g. {PSI_MODEL!r})")
    args = ap.parse_args(argv)
    threads.use(args.threads)
    # Timing only: the models keep their default init, whatever the skeleton.
    warnings.filterwarnings("ignore", category=SkeletonWarning)
    load_before = threads.load_average()
    warning = busy_warning(args.threads, load_before)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = QUICK if args.quick else tuple(MODELS)
    reps = (lambda m: 5) if args.quick else (lambda m: 40 if m > 2e6 else 100)
    xps = [np]
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
        xps.append(cupy)
    except Exception:
        print("CuPy: skipped (not installed or no GPU)")
    jobs = [("torch", n) for n in names] + [(xp, n) for xp in xps for n in names]
    jobs += [(kind, n) for kind in ("e2e", "hooks") for n in (E2E[:1] if args.quick else E2E)]
    jobs += [] if args.quick else [("psi", PSI_MODEL)]
    if args.only:
        jobs = [(k, n) for k, n in jobs if n in args.only]
    rows = []
    for kind, name in tqdm(jobs, desc="step overhead"):
        if kind == "psi":
            rows.append(psi_row(device, 40, not args.no_compile))
            continue
        size = sum(p.numel() for p in MODELS[name][0](MODELS[name][1]).parameters())
        if kind == "torch":
            rows.append(torch_rows(name, device, reps(size), not args.no_compile))
        elif kind == "e2e":  # a whole training step: fewer, longer repetitions
            rows.append(e2e_row(name, device, reps(size) // 3 + 3, not args.no_compile))
        elif kind == "hooks":
            rows.append(hooks_row(name, device, reps(size) // 3 + 3))
        else:
            rows.append(array_rows(name, kind, reps(size)))
    load_after = threads.load_average()
    load = ("" if load_before is None else
            f" Load average (1 min) {load_before:.2f} before, {load_after:.2f} after (the "
            f"run's own){' (BUSY: ratios not comparable)' if warning else ''}.")
    text = (f"{threads.measured_on(machine(device))}{load} Medians of interleaved steps, float32."
            f"\n\n{table(rows)}\n\n{counts_table(device)}")
    print(text)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_overhead.md").write_text(f"# G-SGD step overhead\n\n{text}\n")
    plot(rows, out / "step_overhead.png")
    print(f"wrote {out / 'step_overhead.md'} and {out / 'step_overhead.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
