"""A param group's hyperparameters: read as the backends take them, and checked with
``torch.optim``'s wording."""

from __future__ import annotations

import math
import numbers

import torch

__all__ = ["check_number", "check_sgd_group", "hyper_value"]


def hyper_value(value, name: str) -> float:
    """A group's hyperparameter as the backends take it (a one-element tensor is read;
    ``ValueError`` naming it for a tensor of another size)."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.numel() != 1:
        raise ValueError(f"{name} as a tensor must have one element (as torch.optim.SGD "
                         f"requires), got shape {tuple(value.shape)}")
    return float(value)


def check_number(name: str, value, high: float | None = None) -> None:
    """``ValueError`` unless ``value`` is a finite number in ``[0, high]`` (``>= 0`` without
    ``high``)."""
    value = hyper_value(value, name)
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(
            value) or value < 0 or (high is not None and value > high):
        bound = f"in [0, {high:g}]" if high is not None else ">= 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


def check_sgd_group(group: dict, where: str) -> None:
    """``torch.optim.SGD``'s checks of a group (``where`` names it in the message)."""
    for key in ("lr", "momentum", "weight_decay"):
        check_number(f"{where}{key}", group[key])
    check_number(f"{where}dampening", group["dampening"], high=1.0)
    if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"]):
        raise ValueError(f"{where}nesterov needs momentum > 0 and dampening = 0")
