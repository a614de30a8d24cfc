"""The digits data (1,797 real 8x8 images shipped inside scikit-learn), models, and one run.

A run trains one model with one optimizer at one learning rate from one seed and records the
training loss after every epoch and the validation and test errors at the end. Nothing is
downloaded.
"""

from __future__ import annotations

import math
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


def load(seed: int = 0) -> Data:
    """Digits scaled to [0, 1] and centred; a fixed stratified 60/20/20 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    X_tr, X_rest, y_tr, y_rest = train_test_split(X, y, test_size=0.4, stratify=y,
                                                  random_state=seed)
    X_va, X_te, y_va, y_te = train_test_split(X_rest, y_rest, test_size=0.5, stratify=y_rest,
                                              random_state=seed)
    mean = X_tr.mean(axis=0)
    t = lambda a: torch.tensor(a - mean, dtype=torch.float32)  # noqa: E731
    return Data(t(X_tr), torch.tensor(y_tr), t(X_va), torch.tensor(y_va), t(X_te),
                torch.tensor(y_te))


def mlp(widths, bn: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers += [nn.BatchNorm1d(b), nn.ReLU()] if bn else [nn.ReLU()]
    return nn.Sequential(*layers)


@dataclass(frozen=True)
class Run:
    """One training run. ``init`` is 'he' or 'skeleton' (He, then skeleton weights set to 1,
    paper §11.2); ``spread`` rescales the start by ``exp(spread * N(0, 1))`` per unit."""

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


OPTIMIZERS = {
    "sgd": lambda m, lr: torch.optim.SGD(m.parameters(), lr=lr),
    "sgdm": lambda m, lr: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9),
    "adam": lambda m, lr: torch.optim.Adam(m.parameters(), lr=lr),
    # The paper's experiments: its skeleton initialisation (§11.2) and units.
    "gsgd": lambda m, lr: GSGD(m, lr=lr, skeleton="paper"),
    "gsgdm": lambda m, lr: GSGD(m, lr=lr, momentum=0.9, skeleton="paper"),
    "gadam": lambda m, lr: GAdam(m, lr=lr, skeleton="paper"),
    "pathsgd": lambda m, lr: PathSGD(m, lr=lr),
    "psisgd": lambda m, lr: PSISGD(m, lr=lr),
    "psisgdm": lambda m, lr: PSISGD(m, lr=lr, momentum=0.9),
}


def build(run: Run) -> nn.Sequential:
    torch.manual_seed(run.seed)
    model = mlp(run.widths, bn=run.bn)
    for m in model:
        if isinstance(m, nn.Linear):
            nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
            nn.init.zeros_(m.bias)
    if run.float64:
        model = model.double()
    if run.init == "skeleton":
        skeleton_init_(model, skeleton="paper")
    if run.spread > 0:
        random_rescale_(model, np.random.default_rng(1000 + run.seed), run.spread)
    return model


def _error(model, x, y) -> float:
    return float((model(x).argmax(dim=1) != y).double().mean())


@torch.no_grad()
def _evaluate(model, data: Data):
    model.eval()
    loss = float(F.cross_entropy(model(data.x_train), data.y_train))
    errs = _error(model, data.x_val, data.y_val), _error(model, data.x_test, data.y_test)
    model.train()
    return loss, errs


def train(run: Run, data: Data) -> dict:
    """Train and return ``{'loss': [per epoch], 'val_err', 'test_err', 'diverged'}``."""
    if run.float64:
        data = data.to(torch.float64)
    model = build(run)
    with warnings.catch_warnings():
        if run.spread > 0:  # a rescaled skeleton start is the experiment, not an oversight
            warnings.simplefilter("ignore", SkeletonWarning)
        opt = OPTIMIZERS[run.opt](model, run.lr)
    gen = torch.Generator().manual_seed(run.seed)
    n = len(data.y_train)
    losses = []
    for _ in range(run.epochs):
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n, run.batch):
            idx = perm[i:i + run.batch]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
            opt.step()
        loss, (val_err, test_err) = _evaluate(model, data)
        if not math.isfinite(loss):
            return dict(loss=losses + [math.inf] * (run.epochs - len(losses)),
                        val_err=1.0, test_err=1.0, diverged=True)
        losses.append(loss)
    return dict(loss=losses, val_err=val_err, test_err=test_err, diverged=False)
