"""The six experiments, each returning a :class:`~benchmarks.experiments.Section`."""

from __future__ import annotations

import numpy as np

from gsgd_core import Chain

from . import report
from .digits import Run, train
from .experiments import Arm, Outcome, Section, compare, sgd_arms, table, verdict


def invariant_ratio(b, data, out) -> Section:
    """Paper §5.2 / Table 6 / Fig. 4: MLPs 64-h-h-10, SGD vs G-SGD against H/m."""
    rows, pts = [], []
    for h in b.widths:
        chain = Chain.mlp([64, h, h, 10])
        outs = compare(sgd_arms(b), Run((64, h, h, 10), "sgd", 0.1, 0), b, data, f"h={h}")
        rows += [((str(h), f"{chain.invariant_ratio:.3g}"), o) for o in outs]
        pts += [(chain.invariant_ratio, o.arm.label, o.final("loss"), o.final("test_err"))
                for o in outs]
    fig = report.ratio_figure(out, "invariant_ratio.png", pts)
    return Section("1. Invariant ratio (paper §5.2, Fig. 4)",
                   "MLP 64-h-h-10 with biases; H/m counts biases in m.",
                   [table(rows, ["h", "H/m"]), verdict([((f"h={p[0]}",), o) for p, o in rows])],
                   [(fig, "loss and error against H/m")],
                   data=dict(rows=rows))


def _spreads(b, data, chosen: dict, base: Run, ours: str):
    """Every chosen arm from the balanced start rescaled by each spread (seed 004, Fig. 1):
    table rows, loss curves of seed 0, and the largest relative gap between a curve of
    ``ours`` and the same seed's balanced curve."""
    rows, curves, gaps = [], {}, []
    for spread in b.spreads:
        curves[spread] = {}
        for label, o in chosen.items():
            # compare() already trained the balanced start (spread 0) on every seed
            runs = o.runs if spread == 0 else [
                train(Run(base.widths, o.arm.opt, o.lr, s, "skeleton", spread,
                          epochs=b.epochs, float64=True), data) for s in range(b.seeds)]
            rows.append(((f"{spread:g}",), Outcome(o.arm, o.lr, runs)))
            curves[spread][label] = runs[0]["loss"]
            if label == ours:
                gaps += [np.max(np.abs(np.array(r["loss"]) - np.array(r0["loss"]))
                                / np.array(r0["loss"]))
                         for r, r0 in zip(runs, o.runs)]
    return rows, curves, max(gaps)


def unbalanced(b, data, out) -> Section:
    """Seed 004 Fig. 1: one start rescaled by random positive factors of growing spread."""
    base = Run((64, 64, 64, 10), "sgd", 0.1, 0, float64=True)
    arms = [Arm("SGD", "sgd", "skeleton", b.sgd_grid),
            Arm("G-SGD", "gsgd", "skeleton", b.sgd_grid)]
    chosen = {o.arm.label: o for o in compare(arms, base, b, data, "balanced start")}
    rows, curves, gap = _spreads(b, data, chosen, base, "G-SGD")
    fig = report.spread_figure(out, "unbalanced.png", curves)
    text = ("MLP 64-64-64-10 in float64, skeleton-initialised, then every hidden unit rescaled "
            "by exp(spread·N(0,1)) (the network function is unchanged). lr chosen on the "
            "balanced start. Largest relative difference between a G-SGD loss curve and the "
            f"same seed's balanced curve, over all spreads and seeds: {gap:.2g}.")
    return Section("2. Unbalanced initialisation (seed 004, Fig. 1)", text,
                   [table(rows, ["spread"]),
                    verdict([((f"spread {p[0]}",), o) for p, o in rows])],
                   [(fig, "training loss per spread")],
                   data=dict(max_gap=gap, rows=rows))


def adam(b, data, out) -> Section:
    """G-Adam (Adam on basis-path values) against Adam: a balanced MLP, then the
    unbalanced starts of experiment 2."""
    base = Run((64, 64, 64, 10), "adam", 1e-3, 0, float64=True)
    arms = [Arm("Adam, He init", "adam", "he", b.adam_grid),
            Arm("Adam, skeleton init", "adam", "skeleton", b.adam_grid),
            Arm("G-Adam, skeleton init", "gadam", "skeleton", b.adam_grid)]
    outs = compare(arms, base, b, data, "G-Adam")
    chosen = {o.arm.label: o for o in outs[1:]}
    rows, curves, gap = _spreads(b, data, chosen, base, "G-Adam, skeleton init")
    fig = report.spread_figure(out, "adam_unbalanced.png", curves)
    text = ("MLP 64-64-64-10 in float64. G-Adam keeps Adam's moments per basis path, of the "
            "path gradients, and allocates the step V - Delta to the weights (paper skeleton "
            "init and units). Balanced start first; then the skeleton-initialised start "
            "rescaled by exp(spread·N(0,1)) per hidden unit, lr chosen on the balanced start. "
            "Largest relative difference between a G-Adam loss curve and the same seed's "
            f"balanced curve, over all spreads and seeds: {gap:.2g}.")
    return Section("6. G-Adam: Adam in path space", text,
                   [table([((), o) for o in outs]), verdict([((), o) for o in outs], "G-Adam"),
                    table(rows, ["spread"]),
                    verdict([((f"spread {p[0]}",), o) for p, o in rows], "G-Adam")],
                   [(fig, "training loss per spread, Adam and G-Adam")],
                   data=dict(outcomes=outs, max_gap=gap, rows=rows))


def path_sgd(b, data, out) -> Section:
    """Paper §5.3: a 5-hidden-layer, 64-unit MLP; SGD, Path-SGD, G-SGD."""
    arms = sgd_arms(b)[:2] + [Arm("Path-SGD, He init", "pathsgd", "he", b.path_grid),
                              sgd_arms(b)[2]]
    outs = compare(arms, Run((64,) + (64,) * 5 + (10,), "sgd", 0.1, 0), b, data, "Path-SGD")
    fig = report.curves_figure(out, "path_sgd.png", outs, "MLP 64-(64x5)-10")
    return Section("3. Path-SGD comparison (paper §5.3)", "MLP with five hidden layers of 64.",
                   [table([((), o) for o in outs]), verdict([((), o) for o in outs])],
                   [(fig, "training loss")],
                   data=dict(outcomes=outs))


def batch_norm(b, data, out) -> Section:
    """Seed 004 Table 1, small: an MLP with batch norm; SGD, Adam, PSI-SGD, PSI-SGDM."""
    arms = [Arm("SGD", "sgd", "he", b.sgd_grid), Arm("Adam", "adam", "he", b.adam_grid),
            Arm("PSI-SGD", "psisgd", "he", b.sgd_grid),
            Arm("PSI-SGDM (0.9)", "psisgdm", "he", b.momentum_grid)]
    outs = compare(arms, Run((64, 64, 64, 10), "sgd", 0.1, 0, bn=True), b, data, "batch norm")
    fig = report.curves_figure(out, "batch_norm.png", outs, "MLP 64-64-64-10 with BN")
    return Section("4. Batch norm (seed 004, Table 1, small)",
                   "Linear -> BatchNorm -> ReLU blocks; PSI-SGD updates the BN-followed "
                   "weights, the rest takes SGD(M) with the same lr.",
                   [table([((), o) for o in outs]), verdict([((), o) for o in outs], "PSI")],
                   [(fig, "training loss")], data=dict(outcomes=outs))


def momentum(b, data, out) -> Section:
    """SGD with momentum 0.9 against G-SGD with momentum 0.9 in path space."""
    arms = sgd_arms(b, gsgd="gsgdm", sgd="sgdm", grid=b.momentum_grid)
    outs = compare(arms, Run((64, 64, 64, 10), "sgdm", 0.01, 0), b, data, "momentum")
    fig = report.curves_figure(out, "momentum.png", outs, "MLP 64-64-64-10, momentum 0.9")
    return Section("5. Momentum", "Momentum 0.9 for all; G-SGD keeps its buffer in path space.",
                   [table([((), o) for o in outs]), verdict([((), o) for o in outs])],
                   [(fig, "training loss")],
                   data=dict(outcomes=outs))


EXPERIMENTS = {"ratio": invariant_ratio, "unbalanced": unbalanced, "pathsgd": path_sgd,
               "bn": batch_norm, "momentum": momentum, "adam": adam}
