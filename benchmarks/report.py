"""Plots (matplotlib, PNG) and the markdown summary."""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def curves(ax, outcomes, title):
    """Mean training-loss curve (band: min..max over seeds) per outcome."""
    for o in outcomes:
        L = np.array([r["loss"] for r in o.runs], dtype=float)
        ep = np.arange(1, L.shape[1] + 1)
        with np.errstate(invalid="ignore"):
            ax.plot(ep, np.nanmean(np.where(np.isfinite(L), L, np.nan), axis=0),
                    label=f"{o.arm.label} (lr {o.lr:g})")
            ax.fill_between(ep, np.nanmin(L, axis=0), np.nanmax(np.where(np.isfinite(L), L,
                                                                         np.nan), axis=0),
                            alpha=0.2)
    ax.set_yscale("log")
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend(fontsize=7)


def save(fig, out: pathlib.Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def curves_figure(out, name, outcomes, title) -> str:
    fig, ax = plt.subplots(figsize=(6, 4))
    curves(ax, outcomes, title)
    return save(fig, out, name)


def ratio_figure(out, name, rows) -> str:
    """rows: list of (H/m, label, losses, errors) -> train loss and test error vs H/m."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label in dict.fromkeys(r[1] for r in rows):
        pts = sorted((r for r in rows if r[1] == label), key=lambda r: r[0])
        x = [p[0] for p in pts]
        for ax, k, scale in ((axes[0], 2, 1.0), (axes[1], 3, 100.0)):
            m = [scale * np.mean(p[k]) for p in pts]
            s = [scale * np.std(p[k]) for p in pts]
            ax.errorbar(x, m, yerr=s, marker="o", capsize=3, label=label)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("final training loss")
    axes[1].set_ylabel("test error (%)")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("invariant ratio H/m (smaller = wider MLP 64-h-h-10)")
        ax.legend(fontsize=8)
    return save(fig, out, name)


def spread_figure(out, name, per_spread) -> str:
    """per_spread: {spread: {label: loss curve of seed 0}} -> one panel per optimizer."""
    labels = list(next(iter(per_spread.values())))
    fig, axes = plt.subplots(1, len(labels), figsize=(5 * len(labels), 4), sharey=True)
    for ax, label in zip(np.atleast_1d(axes), labels):
        for spread, by_label in per_spread.items():
            ax.plot(np.arange(1, len(by_label[label]) + 1), by_label[label],
                    label=f"spread {spread:g}", linestyle="-" if spread == 0 else "--")
        ax.set_yscale("log")
        ax.set_title(label)
        ax.set_xlabel("epoch")
        ax.legend(fontsize=8)
    np.atleast_1d(axes)[0].set_ylabel("training loss (seed 0)")
    return save(fig, out, name)


def markdown(sections, header: str) -> str:
    parts = [header]
    for s in sections:
        parts += [f"## {s.title}", s.text]
        parts += s.tables
        parts += [f"![{cap}]({fig})" for fig, cap in s.figures]
    return "\n\n".join(parts) + "\n"
