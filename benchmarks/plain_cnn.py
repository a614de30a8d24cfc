"""``python -m benchmarks.plain_cnn``: G-SGD's skeleton recipes on plain deep CNNs, beside SGD.

VGG-11 and AlexNet (torchvision's layouts, written by hand; no batch norm) fit one fixed
batch of 16 real digit images (scikit-learn's 8x8 digits, upsampled to 32x32 / 64x64, three
channels), from the same He (kaiming normal) start,

- ``SGD``: torch.optim.SGD;
- ``SGD, He skeleton``: SGD from the He skeleton recipe's start (the control for the init);
- ``G-SGD, He skeleton``: ``skeleton_init_(model)`` then ``GSGD(model, ...)`` (the default);
- ``G-SGD, paper skeleton``: every skeleton edge set to 1 (paper §11.2).

All with momentum 0.9 at each learning rate. Widths are divided by ``--div`` (8 by default,
a few minutes on 2 cores); ``--div 1`` is the real size (VGG-11: 129M weights).
Writes ``plain_cnn.md`` and ``plain_cnn.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import math
import pathlib
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from gsgd_adapters.torch import GSGD, SkeletonWarning, skeleton_init_

from . import threads

VGG11 = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


def vgg11(div: int = 1, classes: int = 10) -> nn.Sequential:
    """torchvision's VGG-11 layout without batch norm, every width divided by ``div``."""
    layers, cin = [], 3
    for v in VGG11:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(cin, v // div, 3, padding=1), nn.ReLU(inplace=True)]
            cin = v // div
    hidden = 4096 // div
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(7), nn.Flatten(),
                         nn.Linear(cin * 49, hidden), nn.ReLU(True), nn.Dropout(),
                         nn.Linear(hidden, hidden), nn.ReLU(True), nn.Dropout(),
                         nn.Linear(hidden, classes))


def alexnet(div: int = 1, classes: int = 10) -> nn.Sequential:
    """torchvision's AlexNet layout, every width divided by ``div``."""
    c = [w // div for w in (64, 192, 384, 256, 256, 4096)]
    return nn.Sequential(
        nn.Conv2d(3, c[0], 11, 4, 2), nn.ReLU(True), nn.MaxPool2d(3, 2),
        nn.Conv2d(c[0], c[1], 5, padding=2), nn.ReLU(True), nn.MaxPool2d(3, 2),
        nn.Conv2d(c[1], c[2], 3, padding=1), nn.ReLU(True),
        nn.Conv2d(c[2], c[3], 3, padding=1), nn.ReLU(True),
        nn.Conv2d(c[3], c[4], 3, padding=1), nn.ReLU(True), nn.MaxPool2d(3, 2),
        nn.AdaptiveAvgPool2d(6), nn.Flatten(), nn.Dropout(), nn.Linear(c[4] * 36, c[5]),
        nn.ReLU(True), nn.Dropout(), nn.Linear(c[5], c[5]), nn.ReLU(True),
        nn.Linear(c[5], classes))


NETS = {"VGG-11": (vgg11, 32), "AlexNet": (alexnet, 64)}


def he_init_(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
            nn.init.zeros_(m.bias)
    return model


def batch(size: int, n: int = 16, seed: int = 0):
    """``n`` digit images upsampled to ``size`` x ``size``, three channels, standardised."""
    from sklearn.datasets import load_digits
    X, y = load_digits(return_X_y=True)
    idx = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))[:n]
    x = torch.tensor(X[idx.numpy()], dtype=torch.float32).reshape(n, 1, 8, 8) / 16.0
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    x = (x - x.mean()) / x.std()
    return x.expand(n, 3, size, size).contiguous(), torch.tensor(y[idx.numpy()])


VARIANTS = ("SGD", "SGD, He skeleton", "G-SGD, He skeleton", "G-SGD, paper skeleton")


def make_optimizer(variant: str, model: nn.Module, lr: float, momentum: float):
    """Initialise ``model`` for ``variant`` in place and return its optimizer."""
    if variant == "SGD":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    skeleton = "paper" if "paper" in variant else "he"
    skeleton_init_(model, skeleton=skeleton)
    if variant.startswith("SGD"):
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    return GSGD(model, lr=lr, momentum=momentum, skeleton=skeleton)


def fit(model: nn.Module, opt, x, y, steps: int) -> list[float]:
    """Losses before each of ``steps`` steps on one batch, then after the last."""
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            return losses + [math.nan] * (steps - len(losses) + 1)
        loss.backward()
        opt.step()
    with torch.no_grad():
        losses.append(float(F.cross_entropy(model(x), y)))
    return losses


def verdict(losses: list[float]) -> str:
    """'trains' if the last loss is finite and below the first, with no loss above 10x the
    first on the way; else what went wrong."""
    first, last = losses[0], losses[-1]
    if not all(math.isfinite(v) for v in losses):
        return "diverged (non-finite)"
    if max(losses) > 10 * first:
        return f"unstable (peak {max(losses):.3g})"
    return "trains" if last < first else "does not train"


def run(nets, lrs, steps: int, div: int, momentum: float, seed: int = 0, progress=None):
    """``{(net, lr, variant): losses}`` from one He start per net."""
    out = {}
    for name in nets:
        make, size = NETS[name]
        x, y = batch(size, seed=seed)
        torch.manual_seed(seed)
        start = he_init_(make(div))
        for lr in lrs:
            for variant in VARIANTS:
                model = copy.deepcopy(start)
                torch.manual_seed(seed + 1)  # the same dropout masks for every variant
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", SkeletonWarning)
                    opt = make_optimizer(variant, model, lr, momentum)
                out[name, lr, variant] = fit(model, opt, x, y, steps)
                if progress is not None:
                    progress.update(1)
    return out


def table(results: dict, steps: int) -> str:
    marks = sorted({0, steps // 3, 2 * steps // 3, steps})
    head = ("| net | lr | optimizer | " + " | ".join(f"loss @{m}" for m in marks)
            + " | peak | verdict |")
    rows = [head, "|" + "---|" * (len(marks) + 5)]
    for (name, lr, variant), losses in results.items():
        rows.append(f"| {name} | {lr:g} | {variant} | "
                    + " | ".join(f"{losses[m]:.4g}" for m in marks)
                    + f" | {max(losses):.3g} | {verdict(losses)} |")
    return "\n".join(rows)


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = sorted({(n, lr) for n, lr, _ in results})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    for ax, (name, lr) in zip(axes[0], keys):
        # A linear axis up to 1.3x the starting losses of SGD's runs: a curve that leaves
        # it is named in the legend with its peak instead of squashing the others.
        top = 1.3 * max(results[name, lr, v][0] for v in VARIANTS if v.startswith("SGD"))
        for variant in VARIANTS:
            losses = [v if math.isfinite(v) else float("nan") for v in results[name, lr, variant]]
            peak = max((v for v in losses if v == v), default=float("nan"))
            label = variant if peak <= top else f"{variant} (off scale, peak {peak:.2g})"
            ax.plot(losses, label=label, ls="--" if variant.startswith("SGD") else "-")
        ax.set_ylim(0, top)
        ax.set_title(f"{name}, lr {lr:g}, momentum 0.9")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("training loss on one fixed batch")
    fig.suptitle("Plain CNNs without batch norm: G-SGD's skeleton recipes beside SGD")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plain_cnn", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--div", type=int, default=8, help="divide every width (1: real size)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, nargs="+", default=[0.01, 0.05])
    ap.add_argument("--nets", nargs="+", choices=list(NETS), default=list(NETS))
    ap.add_argument("--out", default="results")
    threads.add_argument(ap, default=None, what="these convolutions on an idle machine")
    args = ap.parse_args(argv)
    threads.announce(threads.use(args.threads), args.threads, default=None)
    from tqdm import tqdm
    with tqdm(total=len(args.nets) * len(args.lr) * len(VARIANTS), desc="runs") as bar:
        results = run(args.nets, args.lr, args.steps, args.div, 0.9, progress=bar)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = table(results, args.steps)
    (out / "plain_cnn.md").write_text(
        f"# Plain CNNs, widths / {args.div}, one fixed batch of 16 digits, momentum 0.9\n\n"
        f"{threads.measured_on()}\n\n{text}\n")
    plot(results, out / "plain_cnn.png")
    print(text)
    print(f"\nwrote {out / 'plain_cnn.md'} and {out / 'plain_cnn.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
