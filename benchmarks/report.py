"""Plots (matplotlib, PNG) and the markdown summary."""

from __future__ import annotations

import pathlib
import re
import shutil

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402
import numpy as np  # noqa: E402

from . import threads  # noqa: E402


BAND = "band: min to max over the stable seeds"


def curves(ax, outcomes, title):
    """Mean training-loss curve of the stable runs per outcome, with a band from their
    minimum to their maximum (an outcome unstable on every seed is named, not drawn)."""
    for o in outcomes:
        runs = o.stable
        if not runs:
            ax.plot([], [], label=f"{o.arm.label} (lr {o.lr:g}): unstable on every seed")
            continue
        L = np.array([r["loss"] for r in runs], dtype=float)
        ep = np.arange(1, L.shape[1] + 1)
        line, = ax.plot(ep, L.mean(axis=0), label=f"{o.arm.label} (lr {o.lr:g})"
                        + (f", {o.unstable} unstable seed(s) left out" if o.unstable else ""))
        ax.fill_between(ep, L.min(axis=0), L.max(axis=0), alpha=0.2, color=line.get_color())
    ax.set_yscale("log")
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss")
    ax.set_title(f"{title}\n({BAND})", fontsize=9)
    ax.legend(fontsize=7)


def save(fig, out: pathlib.Path | None, name: str) -> str:
    """Write ``fig`` to ``out / name`` and close it; ``out=None`` (a dry run, which only
    counts its runs) closes it unrendered, since laying out and rendering are most of a
    figure's cost (about a second each)."""
    if out is not None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def curves_figure(out, name, outcomes, title) -> str:
    fig, ax = plt.subplots(figsize=(6, 4))
    curves(ax, outcomes, title)
    return save(fig, out, name)


def panels_figure(out, name, panels: dict, title: str) -> str:
    """One :func:`curves` panel per ``{panel title: outcomes}``, side by side."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (panel, outcomes) in zip(axes[0], panels.items()):
        curves(ax, outcomes, f"{title}: {panel}")
    return save(fig, out, name)


def ratio_figure(out, name, rows) -> str:
    """rows: list of (H/m, label, losses, errors) of the stable runs -> final training loss
    and test error against H/m, mean with bars from the minimum to the maximum (so a bar
    never leaves the axis's range, as mean ± std would below 0%)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label in dict.fromkeys(r[1] for r in rows):
        pts = sorted((r for r in rows if r[1] == label and len(r[3])), key=lambda r: r[0])
        x = [p[0] for p in pts]
        for ax, k, scale in ((axes[0], 2, 1.0), (axes[1], 3, 100.0)):
            v = [scale * np.asarray(p[k], dtype=float) for p in pts]
            m = np.array([a.mean() for a in v])
            lo, hi = np.array([a.min() for a in v]), np.array([a.max() for a in v])
            ax.errorbar(x, m, yerr=[m - lo, hi - m], marker="o", capsize=3, label=label)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("final training loss")
    axes[1].set_ylabel("test error (%)")
    axes[1].set_ylim(bottom=0)
    for ax in axes:
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels of a short log axis overlap
        ax.set_xlabel("invariant ratio H/m (smaller = wider MLP 64-h-h-10)")
        ax.legend(fontsize=8)
    fig.suptitle("SGD and G-SGD against the invariant ratio: mean of the stable seeds, "
                 "bars from their minimum to their maximum", fontsize=10)
    return save(fig, out, name)


def spread_figure(out, name, per_spread, ours: str, gap: float) -> str:
    """per_spread: {spread: {label: loss curve of seed 0}} -> one panel per optimizer. The
    loss axis stops at 10x the highest loss of ``ours`` (a curve above it is clipped and
    its peak written on the panel); when the curves of ``ours`` coincide (relative gap
    below 1e-9), the panel says that its lines lie on top of each other."""
    labels = list(next(iter(per_spread.values())))
    finite = [v for c in (per_spread[s][ours] for s in per_spread) for v in c
              if np.isfinite(v)]
    top = 10 * max(finite) if finite else None
    fig, axes = plt.subplots(1, len(labels), figsize=(5 * len(labels), 4), sharey=True)
    for ax, label in zip(np.atleast_1d(axes), labels):
        notes = []
        for spread, by_label in per_spread.items():
            c = np.asarray(by_label[label], dtype=float)
            ax.plot(np.arange(1, len(c) + 1), np.where(np.isfinite(c), c, np.nan),
                    label=f"spread {spread:g}", linestyle="-" if spread == 0 else "--")
            peak = np.nanmax(np.where(np.isfinite(c), c, np.nan)) if np.isfinite(c).any() \
                else np.inf
            if not np.isfinite(c).all():
                notes.append(f"spread {spread:g}: non-finite loss")
            elif top is not None and peak > top:
                notes.append(f"spread {spread:g}: clipped, peak {peak:.2g}")
        if label == ours and gap < 1e-9:
            notes.append(f"all {len(per_spread)} curves coincide (max relative\n"
                         f"difference {gap:.1g}): one visible line")
        if notes:
            ax.text(0.03, 0.03, "\n".join(notes), transform=ax.transAxes, fontsize=8,
                    va="bottom", bbox=dict(facecolor="white", alpha=0.8, edgecolor="none"))
        ax.set_yscale("log")
        ax.set_title(label)
        ax.set_xlabel("epoch")
        ax.legend(fontsize=8)
    if top is not None:
        np.atleast_1d(axes)[0].set_ylim(top=top)
    np.atleast_1d(axes)[0].set_ylabel("training loss (seed 0)")
    fig.suptitle("One start rescaled per hidden unit by exp(spread·N(0,1)): same function, "
                 "unbalanced weights", fontsize=10)
    return save(fig, out, name)


def markdown(sections, header: str) -> str:
    """The results page: ``header``, when and where it was measured, then each section."""
    parts = [header, threads.measured_on()]
    for s in sections:
        parts += [f"## {s.title}", s.text]
        parts += s.tables
        parts += [f"![{cap}]({fig})" for fig, cap in s.figures]
    return "\n\n".join(parts) + "\n"


START = ("<!-- results excerpt: generated from docs/results.md by "
         "`python -m benchmarks --update-docs`; do not edit by hand -->")
END = "<!-- end of results excerpt -->"


VERDICT = re.compile(r"^- (?P<where>[^:]+): (?P<rest>.*)$")
OUTCOME = re.compile(r"^(?P<who>.+?) (?P<word>wins|loses|ties|is unstable on \d+/\d+ seeds"
                     r"|is the only stable optimizer)")


def short_verdict(bullet: str) -> str:
    """A verdict line of ``summary.md`` without its figures: where, who, and the outcome
    (``"h=16: G-SGD, skeleton init is unstable on 2/5 seeds"``); ``overall`` is left out."""
    where, rest = VERDICT.match(bullet).group("where", "rest")
    outcome = OUTCOME.match(rest)
    text = f"{outcome['who']} {outcome['word']}" if outcome else rest.split(":")[0]
    return text if where == "overall" else f"{where}: {text}"


def readme_excerpt(summary: str) -> str:
    """The README's results excerpt from a ``summary.md``: the run's size, wall and CPU time
    and the machine's load, then one table row per experiment with its verdicts, shortened
    (the figures stay in the table that ``docs/results.md`` links)."""
    total = re.search(r"Total \d+ s for \d+ runs on \d+ CPU thread\(s\)\."
                      r"( \d+ CPU s(, load average [\d.]+ at the end)?\.)?", summary)
    lines = [f"From [`docs/results.md`](docs/results.md) (`python -m benchmarks`, default "
             f"budget; {total.group(0) if total else 'time not recorded.'})", "",
             "| experiment | verdicts |", "|---|---|"]
    for block in summary.split("\n## ")[1:]:
        title, _, body = block.partition("\n")
        bullets = [short_verdict(ln) for ln in body.splitlines() if VERDICT.match(ln)]
        if bullets:
            lines.append(f"| **{title.strip()}** | {'; '.join(bullets)} |")
    return "\n".join(lines)


def update_docs(summary: str, out: pathlib.Path, root: pathlib.Path) -> None:
    """``summary`` (and the plots it links) into ``docs/``, and the README's excerpt
    (between :data:`START` and :data:`END`) regenerated from it."""
    docs = root / "docs"
    for png in re.findall(r"\]\(([\w.-]+\.png)\)", summary):
        shutil.copyfile(out / png, docs / png)
    (docs / "results.md").write_text(summary)
    readme = root / "README.md"
    text = readme.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{readme_excerpt(summary)}\n{END}{tail}")
