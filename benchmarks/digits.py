"""The digits data (1,797 real 8x8 images shipped inside scikit-learn), models, and one run.

A run trains one model with one optimizer at one learning rate from one seed and records the
training loss before training and after every epoch, the validation and test errors at the
end, the CPU time per epoch, and whether it was unstable. Nothing is downloaded.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from gsgd_adapters.torch import (GSGD, PSISGD, GAdam, PathSGD, SkeletonWarning, random_rescale_,
                                 skeleton_init_)


@dataclass(frozen=True)
class Data:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    def to(self, dtype) -> "Data":
        return Data(*(t.to(dtype) if t.is_floating_point() else t for t in (
            self.x_train, self.y_train, self.x_val, self.y_val, self.x_test, self.y_test)))


def split(X: np.ndarray, y: np.ndarray, seed: int, centre: bool) -> Data:
    """A fixed stratified 60/20/20 split into train, validation and test (float32 inputs),
    centred on the training mean if ``centre``."""
    from sklearn.model_selection import train_test_split
    X_tr, X_rest, y_tr, y_rest = train_test_split(X, y, test_size=0.4, stratify=y,
                                                  random_state=seed)
    X_va, X_te, y_va, y_te = train_test_split(X_rest, y_rest, test_size=0.5, stratify=y_rest,
                                              random_state=seed)
    mean = X_tr.mean(axis=0) if centre else 0.0
    t = lambda a: torch.tensor(a - mean, dtype=torch.float32)  # noqa: E731
    return Data(t(X_tr), torch.tensor(y_tr), t(X_va), torch.tensor(y_va), t(X_te),
                torch.tensor(y_te))


def load(seed: int = 0) -> Data:
    """Digits scaled to [0, 1] and centred; a fixed stratified 60/20/20 split."""
    from sklearn.datasets import load_digits
    X, y = load_digits(return_X_y=True)
    return split(X / 16.0, y, seed, centre=True)


def mlp(widths, bn: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers += [nn.BatchNorm1d(b), nn.ReLU()] if bn else [nn.ReLU()]
    return nn.Sequential(*layers)


def plain_cnn(channels, bn: bool = False, side: int = 8) -> nn.Sequential:
    """A VGG-style plain CNN on flat ``side x side`` images (8 for the digits, 28 for MNIST):
    two blocks of two 3x3 convolutions (``c1``, then ``c2`` channels) each followed by 2x2 max
    pooling, then Linear(``c2 (side // 4)^2``, ``hidden``) and Linear(``hidden``, 10); ReLU
    everywhere, batch norm after each convolution if ``bn``. ``channels = (c1, c2,
    hidden)``."""
    c1, c2, hidden = channels
    layers: list[nn.Module] = [nn.Unflatten(1, (1, side, side))]
    cin = 1
    for c in (c1, c1, "M", c2, c2, "M"):
        if c == "M":
            layers.append(nn.MaxPool2d(2))
            continue
        layers.append(nn.Conv2d(cin, c, 3, padding=1))
        layers += [nn.BatchNorm2d(c), nn.ReLU()] if bn else [nn.ReLU()]
        cin = c
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(c2 * (side // 4) ** 2, hidden),
                         nn.ReLU(),
                         nn.Linear(hidden, 10))


@dataclass(frozen=True)
class Run:
    """One training run. ``init``: 'he' (kaiming normal), 'skeleton' (He, then skeleton
    edges set to 1, paper §11.2) or 'he-skeleton' (He, then the He skeleton recipe, skeleton
    guide); ``spread`` rescales the start by ``exp(spread * N(0, 1))`` per unit; ``arch``:
    'mlp' (``widths`` are the layer widths) or 'cnn' (:func:`plain_cnn`, ``widths`` its
    channels); ``data``: the data set it trains on, a key of :data:`SIDE`."""

    widths: tuple
    opt: str
    lr: float
    seed: int
    init: str = "he"
    spread: float = 0.0
    bn: bool = False
    epochs: int = 20
    batch: int = 64
    float64: bool = False
    arch: str = "mlp"
    data: str = "digits"


#: The image side of each data set (the CNN's input shape).
SIDE = {"digits": 8, "mnist": 28}


OPTIMIZERS = {
    "sgd": lambda m, lr: torch.optim.SGD(m.parameters(), lr=lr),
    "sgdm": lambda m, lr: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9),
    "adam": lambda m, lr: torch.optim.Adam(m.parameters(), lr=lr),
    # The paper's experiments: its skeleton initialisation (§11.2) and units.
    "gsgd": lambda m, lr: GSGD(m, lr=lr, skeleton="paper"),
    "gsgdm": lambda m, lr: GSGD(m, lr=lr, momentum=0.9, skeleton="paper"),
    # The recipe for real nets (skeleton guide): He skeleton units.
    "gsgd-he": lambda m, lr: GSGD(m, lr=lr),
    "gsgdm-he": lambda m, lr: GSGD(m, lr=lr, momentum=0.9),
    "gadam": lambda m, lr: GAdam(m, lr=lr, skeleton="paper"),
    "pathsgd": lambda m, lr: PathSGD(m, lr=lr),
    "psisgd": lambda m, lr: PSISGD(m, lr=lr),
    "psisgdm": lambda m, lr: PSISGD(m, lr=lr, momentum=0.9),
}


def build(run: Run) -> nn.Sequential:
    torch.manual_seed(run.seed)
    model = (plain_cnn(run.widths, bn=run.bn, side=SIDE[run.data]) if run.arch == "cnn"
             else mlp(run.widths, bn=run.bn))
    for m in model:
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
            nn.init.zeros_(m.bias)
    if run.float64:
        model = model.double()
    if run.init in ("skeleton", "he-skeleton"):
        skeleton_init_(model, skeleton="paper" if run.init == "skeleton" else "he")
    if run.spread > 0:
        random_rescale_(model, np.random.default_rng(1000 + run.seed), run.spread)
    return model


#: Evaluation batch: a CNN's forward on all 3,000 MNIST training images at once is four
#: times slower than in batches of this size (its activations leave the caches).
EVAL_BATCH = 250


@torch.no_grad()
def _evaluate(model, x, y, fn):
    model.eval()
    value = fn(torch.cat([model(x[i:i + EVAL_BATCH]) for i in range(0, len(x), EVAL_BATCH)]),
               y)
    model.train()
    return float(value)


def _loss(model, data: Data) -> float:
    """The training loss on the whole training split."""
    return _evaluate(model, data.x_train, data.y_train, F.cross_entropy)


def _errors(model, data: Data) -> tuple[float, float]:
    """Validation and test errors (evaluated once, after training: they are not curves)."""
    wrong = lambda out, y: (out.argmax(dim=1) != y).double().mean()  # noqa: E731
    return (_evaluate(model, data.x_val, data.y_val, wrong),
            _evaluate(model, data.x_test, data.y_test, wrong))


def train(run: Run, data: Data) -> dict:
    """Train and return ``{'loss0', 'loss': [per epoch], 'val_err', 'test_err', 'diverged',
    'unstable', 'epoch_seconds'}``: ``loss0`` is the training loss before the first step;
    ``diverged``: the loss became non-finite (the errors are then 100%); ``unstable``:
    diverged, or the final loss is above ``loss0``; ``epoch_seconds``: CPU seconds of the
    training steps per epoch (evaluation excluded; CPU time, so other processes on the
    machine do not inflate it)."""
    if run.float64:
        data = data.to(torch.float64)
    model = build(run)
    with warnings.catch_warnings():
        if run.spread > 0:  # a rescaled skeleton start is the experiment, not an oversight
            warnings.simplefilter("ignore", SkeletonWarning)
        opt = OPTIMIZERS[run.opt](model, run.lr)
        opt.step()  # its first step checks the skeleton: no gradient yet, nothing moves
    gen = torch.Generator().manual_seed(run.seed)
    n = len(data.y_train)
    loss0, losses, cpu = _loss(model, data), [], 0.0
    for _ in range(run.epochs):
        t0 = time.process_time()
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n, run.batch):
            idx = perm[i:i + run.batch]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
            opt.step()
        cpu += time.process_time() - t0
        loss = _loss(model, data)
        if not math.isfinite(loss):
            return dict(loss0=loss0, loss=losses + [math.inf] * (run.epochs - len(losses)),
                        val_err=1.0, test_err=1.0, diverged=True, unstable=True,
                        epoch_seconds=cpu / (len(losses) + 1))
        losses.append(loss)
    val_err, test_err = _errors(model, data)
    return dict(loss0=loss0, loss=losses, val_err=val_err, test_err=test_err, diverged=False,
                unstable=unstable(loss0, losses[-1]), epoch_seconds=cpu / run.epochs)


def unstable(loss0: float, final: float) -> bool:
    """A run failed if its final training loss is not finite or above its loss before
    training (written so that NaN counts as a failure)."""
    return not (math.isfinite(final) and final <= loss0)
