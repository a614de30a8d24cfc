"""State dicts saved by earlier versions of the torch optimizers load into this one and
resume bit for bit (tests/fixtures/make_state_dicts.py wrote them: ``state_dicts_v1.pt``
before the skeleton states were kept, ``state_dicts_v2.pt`` with them)."""

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
def test_a_saved_state_dict_resumes_bit_for_bit(files, version, name):
    """The model's and the optimizer's state dicts load into a fresh model and optimizer,
    and the next steps give the saved run's parameters exactly, with no SkeletonWarning."""
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
        assert torch.equal(p.detach(), want), (name, i)
