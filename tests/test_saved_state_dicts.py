"""State dicts saved by earlier versions of the torch optimizers load into this one and
resume the saved run (tests/fixtures/make_state_dicts.py wrote them: ``state_dicts_v1.pt``
before the skeleton states were kept, ``state_dicts_v2.pt`` with them). The run is in
float64 and agrees to 1e-9: on the CPU that wrote it, bit for bit; on another CPU its
matrix kernels round differently, and Adam's first steps divide a near-zero gradient by
its own square root, which makes a rounding of 1e-16 one of 1e-11 (a buffer lost or
misread changes the parameters by 1e-3 or more)."""

import copy
import pathlib
import sys
import warnings

import pytest
import torch

from gsgd_adapters.torch import SkeletonWarning

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import make_state_dicts as saved_by  # noqa: E402

CASES = [(version, name) for version in ("v1", "v2") for name in saved_by.OPTIMIZERS]


@pytest.fixture(scope="module")
def files() -> dict:
    return {v: torch.load(FIXTURES / f"state_dicts_{v}.pt", weights_only=True)
            for v in ("v1", "v2")}


@pytest.mark.parametrize("version, name", CASES)
def test_a_saved_state_dict_resumes_the_saved_run(files, version, name):
    """The model's and the optimizer's state dicts load into a fresh model and optimizer,
    and the next steps give the saved run's parameters, with no SkeletonWarning."""
    ck = copy.deepcopy(files[version][name])
    net = saved_by.model()
    opt = saved_by.OPTIMIZERS[name](net)
    net.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as they were saved: bits depend on how reductions are split
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", SkeletonWarning)
            saved_by.train(net, opt)
    finally:
        torch.set_num_threads(threads)
    for i, (p, want) in enumerate(zip(net.parameters(), ck["after"], strict=True)):
        torch.testing.assert_close(p.detach(), want, rtol=1e-9, atol=1e-9,
                                   msg=lambda m, i=i: f"{name}, parameter {i}: {m}")
