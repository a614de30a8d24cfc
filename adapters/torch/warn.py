"""The torch optimizers' warnings, pointed at the user's call."""

from __future__ import annotations

import sys
import warnings

__all__ = ["SkeletonWarning", "SkippedStepWarning", "warn_user"]


class SkeletonWarning(UserWarning):
    """G-SGD was built on chains whose skeleton is not initialised (see ``skeleton_init_``),
    or that the weights cannot tell from trained ones."""


class SkippedStepWarning(UserWarning):
    """A part's step (a chain, or a group's parameters outside chains) was skipped because
    a gradient held NaN or Inf."""


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` pointed at the first frame outside ``gsgd_adapters`` and torch: the
    user's call, however deep the subclassing, and through torch's wrappers of
    ``Optimizer.step``.

    The frames are counted from this function's own, the frame that ``warnings.warn``
    counts its ``stacklevel`` from, so whatever stands between the user and here (a
    decorator, a wrapper) is counted as ``warnings.warn`` will count it."""
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in (
            "gsgd_adapters", "torch"):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
