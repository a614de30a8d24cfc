"""G-SGD, G-Adam and Path-SGD on models sharded by FSDP2 on a 2x2 mesh (HSDP: replicated
over one dimension, split by rows over the other) over 4 spawned gloo processes, equal to
one unsharded process; tensor parallelism refused, naming the layout."""

import pytest
import torch

from _helpers import DEFAULT_INIT, process_group, spawn_workers
from gsgd_adapters.torch import GSGD

pytest.importorskip("torch.distributed.tensor", reason="torch.distributed missing")
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import _fsdp_worker as fw  # noqa: E402
import _hsdp_worker as hw  # noqa: E402

pytestmark = DEFAULT_INIT


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """The workers' runs on 4 spawned processes, once for the module."""
    tmp = tmp_path_factory.mktemp("hsdp")
    out = tmp / "runs.pt"
    spawn_workers(hw.worker, (hw.WORLD, str(tmp / "init"), str(out)), hw.WORLD, out)
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("name", hw.NAMES)
def test_hsdp_equals_one_process(run, name):
    """10 steps of every parameter placed (Replicate(), Shard(0)) equal one process's to
    1e-12, momentum buffers and Adam moments too: G-SGD and G-Adam on each process's rows,
    Path-SGD on the gathered layers."""
    assert set(run["placements"][name]) == {"(Replicate(), Shard(dim=0))"}
    fw.assert_close(run[name], fw.one_process(name))


def test_check_finite_raises_on_every_process_and_replica(run):
    """A NaN in the last process's rows: all four raise, its replica and the other replica
    group too (none is left waiting in a collective)."""
    assert run["check_finite"] == ["non-finite gradient in 2.weight"] * hw.WORLD


def test_tensor_parallelism_is_refused_naming_the_layout():
    """An MLP under parallelize_module, ColwiseParallel then RowwiseParallel: the second
    layer's weight, split over its input units, is refused when the optimizer is built."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    with process_group("fake", fake_pg.FakeStore(), 0, 2):
        model = parallelize_module(fw.build("gsgd_mlp"), init_device_mesh("cpu", (2,)),
                                   {"0": ColwiseParallel(), "2": RowwiseParallel()})
        with pytest.raises(ValueError, match=r"^2\.weight is a DTensor placed \(Shard\(dim=1\),\) "
                           r"on a 1-D mesh, split over its input units \(tensor parallelism: "
                           r"RowwiseParallel"):
            GSGD(model, lr=0.1)
