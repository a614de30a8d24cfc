"""``python -m benchmarks``: the papers' experiments on scikit-learn's digits.

Prints result tables and writes PNG plots and ``summary.md`` to ``--out`` (default
``results/``). Nothing is downloaded: the digits ship inside scikit-learn.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

from . import report, threads
from .digits import load
from .experiments import DEFAULT, QUICK
from .suite import EXPERIMENTS

DESCRIPTIONS = {
    "ratio": "invariant ratio: MLP 64-h-h-10 for h in 8..256, SGD vs G-SGD (paper §5.2)",
    "unbalanced": "unbalanced init: one start rescaled by growing random factors (seed 004)",
    "pathsgd": "Path-SGD: 5x64 MLP, SGD vs Path-SGD vs G-SGD (paper §5.3)",
    "bn": "batch norm: SGD, Adam, PSI-SGD, PSI-SGDM (seed 004, Table 1)",
    "momentum": "momentum 0.9: SGD vs G-SGD with momentum in path space",
    "adam": "G-Adam vs Adam: balanced MLP and unbalanced starts (Adam in path space)",
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Reproduce the G-SGD and PSI-SGD papers' experiments on scikit-learn's "
                    "digits (1,797 real 8x8 images).\n\nexperiments:\n" + "\n".join(
                        f"  {k:<11} {v}" for k, v in DESCRIPTIONS.items()))
    parser.add_argument("--quick", action="store_true", help="a small budget (under 60 s)")
    parser.add_argument("--out", default="results", help="output folder (default: results/)")
    parser.add_argument("--only", nargs="+", choices=list(EXPERIMENTS), metavar="NAME",
                        help="run only these experiments")
    threads.add_argument(parser)
    args = parser.parse_args(argv)
    n_threads = threads.use(args.threads)
    threads.announce(n_threads, args.threads)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = QUICK if args.quick else DEFAULT
    data = load()
    start, sections = time.perf_counter(), []
    for name in args.only or list(EXPERIMENTS):
        t0 = time.perf_counter()
        section = EXPERIMENTS[name](budget, data, out)
        sections.append(section)
        print(f"\n## {section.title}  ({time.perf_counter() - t0:.0f} s)\n{section.text}")
        for t in section.tables:
            print(t)
    header = (f"# G-SGD on digits ({'quick' if args.quick else 'default'} budget)\n\n"
              f"{budget.seeds} seeds, {budget.epochs} epochs, batch 64; learning rates chosen "
              f"on a validation split (mean of two seeds); mean ± std over seeds. Total "
              f"{time.perf_counter() - start:.0f} s on {n_threads} CPU thread(s).")
    (out / "summary.md").write_text(report.markdown(sections, header))
    print(f"\nwrote {out / 'summary.md'} and {len(sections)} plot(s) in {out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
