"""G-SGD and friends on models sharded by FSDP2 (``fully_shard``), 2 and 3 CPU processes
over gloo: equal to one process, invariant, skipping together, checkpointed with DCP."""

import os
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch

from _helpers import DEFAULT_INIT, spawn_workers

pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(),
                                 reason="torch.distributed missing"), DEFAULT_INIT]


import _fsdp_worker as fw  # noqa: E402


def _spawn(world: int, tmp, ckpt: str = "") -> dict:
    out = tmp / f"world{world}.pt"
    spawn_workers(fw.worker, (world, str(tmp / f"init{world}"), str(tmp), ckpt), world, out)
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    return {2: _spawn(2, tmp, str(tmp / "ckpt")), 3: _spawn(3, tmp)}, tmp / "ckpt"


def _one_process(name: str) -> dict:
    model = fw.build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = fw.SCENARIOS[name][1](model)
    x, y = fw.data(model)
    fw.train(model, opt, x, y, fw.SCENARIOS[name][2])
    return fw.full_state(model, opt)


def _assert_close(got: dict, want: dict, rtol: float = 1e-12) -> None:
    assert got.keys() == want.keys()
    for k, w in want.items():
        g = got[k]
        assert g.shape == w.shape and g.dtype == w.dtype, k
        scale = max(1.0, float(w.abs().max())) if w.is_floating_point() else 1.0
        err = float((g - w).abs().max()) if g.numel() else 0.0
        assert err <= rtol * scale, f"{k}: differs by {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(fw.SCENARIOS))
def test_sharded_equals_one_process(runs, world, name):
    """10 steps on FSDP2-sharded weights (uneven shards over 3 processes, an empty one for
    the conv's 2-row head) equal one process's, momentum buffers and Adam moments too."""
    _assert_close(runs[0][world][name], _one_process(name))


def _function(state: dict, x):
    model = fw.mlp()
    model.load_state_dict({k[len("param/"):]: v for k, v in state.items()
                           if k.startswith("param/")})
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("world", [2, 3])
def test_each_sharded_chain_keeps_one_row_shard_across_steps(runs, world):
    """G-SGD and G-Adam step a sharded chain through one RowShard, built on the first step
    and kept (its plan with it); Path-SGD and PSI keep none."""
    steppers = runs[0][world]["steppers"]
    for name in fw.SCENARIOS:
        chains = {"gsgd_normed": 1, "pathsgd_mlp": 0, "psi_normed": 0}.get(name, 1)
        assert steppers[name] == ["RowShard"] * chains + ["kept"], name


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_twins_coincide(runs, world):
    """A rescaled twin, sharded, trains to the same function (Theorem 3.6 under FSDP2),
    and the comparison sees a difference: the twin's weights are not the original's."""
    res = runs[0][world]
    x = fw.data(fw.mlp())[0]
    a, b = _function(res["gsgd_mlp"], x), _function(res["gsgd_twin"], x)
    assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        start = fw.build("gsgd_mlp")(x)
    assert not torch.allclose(a, start, atol=1e-3)  # training moved the function
    assert not torch.allclose(res["gsgd_mlp"]["param/0.weight"],
                              res["gsgd_twin"]["param/0.weight"], atol=1e-3)


@pytest.mark.parametrize("world", [2, 3])
def test_nan_on_one_process_skips_everywhere(runs, world):
    """A NaN in the last process's local gradient: every process skips the step (weights
    and momentum bit for bit unchanged, one skip counted everywhere)."""
    nan = runs[0][world]["nan"]
    assert nan["skipped"] == [1] * world
    assert nan["warned"]
    for k, v in nan["before"].items():
        assert torch.equal(nan["after"][k], v), k


@pytest.mark.parametrize("world", [2, 3])
def test_skeleton_init_after_sharding(runs, world):
    """skeleton_init_ on a sharded model initialises it as on the whole model."""
    torch.manual_seed(0)
    model = fw.conv()
    fw.skeleton_init_(model)
    got = runs[0][world]["init_after_sharding"]
    for n, p in model.named_parameters():
        assert torch.equal(got[f"param/{n}"], p.detach()), n


def test_unsupported_layouts_are_refused(runs):
    """A chain with some layers sharded and some not, or weights split by columns (tensor
    parallelism), is refused when the optimizer is built, naming the parameter."""
    errors = runs[0][2]["errors"]
    assert "2.weight is a plain tensor in a chain" in errors["mixed"]
    assert "0.weight is a DTensor placed (Shard(dim=1),)" in errors["columns"]
    assert "tensor parallelism" in errors["columns"]


@pytest.mark.parametrize("world", [2, 3])
def test_check_finite_raises_on_every_process(runs, world):
    """check_finite=True and a NaN on one process: every process raises (none is left
    waiting in a collective), naming the parameter."""
    assert runs[0][world]["check_finite"] == ["non-finite gradient in 2.weight"] * world


def test_checkpoint_two_to_two_bit_for_bit(runs):
    """DCP save on 2 processes, load on 2 into a differently seeded model: the loaded
    state equals the saved one and 5 more steps equal the uninterrupted run, bit for bit."""
    ck = runs[0][2]["checkpoint"]
    for k, v in ck["saved"].items():
        assert torch.equal(ck["loaded"][k], v), k
    for k, v in ck["straight"].items():
        assert torch.equal(ck["resumed"][k], v), k


# DCP warns that it loads into one process: that is this test's point
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_checkpoint_two_to_one(runs):
    """The 2-process checkpoint loaded by one process (no process group) holds the saved
    state bit for bit, and 5 more steps on the whole batch match the sharded run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    ck, path = runs[0][2]["checkpoint"], runs[1]
    name = "gsgd_mlp"
    torch.manual_seed(123)
    model = fw.SCENARIOS[name][0]()
    opt = fw.SCENARIOS[name][1](model)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    loaded = fw.full_state(model, opt)
    for k, v in ck["saved"].items():
        assert torch.equal(loaded[k], v), k
    x, y = fw.data(model)
    fw.train(model, opt, x, y, 5)
    _assert_close(fw.full_state(model, opt), ck["straight"])


ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "fsdp_example.py"


def test_the_distributed_guide_shows_the_example_script():
    """The distributed guide's FSDP2 block is docs/fsdp_example.py, word for word."""
    guide = (ROOT / "docs" / "guide" / "distributed.md").read_text()
    assert f"```py\n{EXAMPLE.read_text()}```" in guide


def test_example_script_runs_on_two_processes(tmp_path):
    """docs/fsdp_example.py under torchrun: trains, checkpoints, reloads, and finds the
    chain on the sharded model."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", str(EXAMPLE)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 chain(s)" in proc.stdout and "skeleton initialised (he)" in proc.stdout
    assert (tmp_path / "gsgd_checkpoint").is_dir()
