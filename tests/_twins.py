"""Twin models stepped in lockstep: two optimizers on copies of one model, then compared."""

import torch


def step_twins(pairs, inputs) -> None:
    """Every ``(model, optimizer)`` of ``pairs`` takes one step per input, in turn:
    ``zero_grad``, the sum of squares of the output backpropagated, ``step``."""
    for x in inputs:
        for model, opt in pairs:
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()


def assert_same_parameters(a, b, rtol: float = 1e-12, atol: float = 1e-14) -> None:
    """Every parameter of model ``a`` equals model ``b``'s (to float64 rounding unless told
    otherwise)."""
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol)
