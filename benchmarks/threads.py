"""CPU threads for the benchmarks' small workloads, and how busy the machine is.

Digits-sized nets (MLPs of 8 to 256 units, small CNNs, batch 64) do a few microseconds of
arithmetic per operation. Extra threads add synchronisation, and on a machine where other
processes hold the cores, the threads spin waiting for cores they cannot get. So the digits
entry points run on one thread by default, ``--threads N`` overrides, and each prints the
count it uses (measurements in the README, "Busy machines").
"""

from __future__ import annotations

import os
import pathlib
import platform
import sys
import time

DEFAULT = 1


def add_argument(parser, default: int | None = DEFAULT, what: str = "digits-sized nets") -> None:
    """``--threads N`` for an entry point; ``default=None`` keeps the libraries' own count."""
    keep = "the libraries' default" if default is None else str(default)
    parser.add_argument("--threads", type=int, default=default, metavar="N",
                        help=f"CPU threads (default {keep}: the fastest for {what})")


def use(n: int | None, *, jax: bool = False) -> int:
    """Run torch (and NumPy's BLAS, and with ``jax`` XLA) on ``n`` threads; ``None`` keeps
    torch's own count. Returns the count in use. XLA has no thread setting, so for JAX the
    process is restricted to ``n`` cores (before its first computation)."""
    try:
        import torch
    except ImportError:  # the NumPy/CuPy loop runs without torch
        torch = None
    if n is not None:
        if n < 1:
            raise SystemExit(f"--threads must be at least 1, got {n}")
        if torch is not None:
            torch.set_num_threads(n)
        try:
            from threadpoolctl import threadpool_limits
            threadpool_limits(limits=n)
        except ImportError:  # NumPy's BLAS keeps its count; the nets here barely use it
            pass
        if jax and hasattr(os, "sched_setaffinity"):
            cores = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, cores[:n])
    return torch.get_num_threads() if torch is not None else (n or os.cpu_count())


def cpu_name() -> str:
    """The CPU's model name (Linux's ``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measured_on(machine: str | None = None) -> str:
    """A results page's provenance line: today's date (UTC) and the machine, by default this
    CPU and its core count."""
    machine = machine or f"{cpu_name()}, {os.cpu_count()} cores"
    return f"Measured {time.strftime('%Y-%m-%d', time.gmtime())} on {machine}."


def load_average() -> float | None:
    """The 1-minute load average, where the OS reports one."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def describe(n: int, requested: int | None, default: int | None = DEFAULT) -> str:
    """One line: the thread count, why, and the machine's load."""
    load = load_average()
    why = ("--threads" if requested is not None and requested != default
           else "the default: the fastest for these sizes" if default is not None
           else "the libraries' default")
    busy = "" if load is None else f"; load average {load:.2f} on {os.cpu_count()} cores"
    return f"CPU threads: {n} ({why}{busy})"


def announce(n: int, requested: int | None, default: int | None = DEFAULT) -> None:
    print(describe(n, requested, default), file=sys.stderr, flush=True)
