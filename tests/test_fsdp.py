"""G-SGD and friends on models sharded by FSDP2 (``fully_shard``) over gloo: a world of one
(this process) and spawned worlds of 2 and 3 CPU processes, equal to one unsharded process,
invariant, skipping together, checkpointed with DCP."""

import collections
import contextlib
import copy
import os
import pathlib
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from _helpers import DEFAULT_INIT, process_group, spawn_workers
from gsgd_adapters.torch import SkeletonWarning, fsdp
from gsgd_core import Chain

pytest.importorskip("torch.distributed.tensor", reason="torch.distributed missing")
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402

import _fsdp_worker as fw  # noqa: E402

pytestmark = DEFAULT_INIT


def _spawn(world: int, tmp, ckpt: str = "") -> dict:
    out = tmp / f"world{world}.pt"
    spawn_workers(fw.worker, (world, str(tmp / f"init{world}"), str(tmp), ckpt), world, out)
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    return {2: _spawn(2, tmp, str(tmp / "ckpt")), 3: _spawn(3, tmp)}, tmp / "ckpt"


@pytest.fixture(scope="module")
def in_process():
    """The runs of the spawned workers, sharded over a gloo world of one: this process."""
    with process_group(), warnings.catch_warnings():
        warnings.simplefilter("ignore", SkeletonWarning)  # the twin's, as in workers
        return fw.sharded_runs(0, 1, init_device_mesh("cpu", (1,)))


@pytest.fixture(scope="module", params=[1, 2, 3])
def world(request) -> int:
    """How many processes share the model (module-scoped: pytest runs every test on the
    world of one first, and a failure there needs no workers)."""
    return request.param


@pytest.fixture
def run(request, world) -> dict:
    """The runs over ``world`` processes: 1 in this process, 2 and 3 spawned."""
    if world == 1:
        return request.getfixturevalue("in_process")
    return request.getfixturevalue("runs")[0][world]


@pytest.mark.parametrize("name", list(fw.SCENARIOS))
def test_sharded_equals_one_process(run, world, name):
    """10 steps on FSDP2-sharded weights (uneven shards over 3 processes, an empty one for
    the conv's 2-row head) equal one process's, momentum buffers and Adam moments too."""
    fw.assert_close(run[name], fw.one_process(name))


def _function(state: dict, x):
    model = fw.mlp()
    model.load_state_dict({k[len("param/"):]: v for k, v in state.items()
                           if k.startswith("param/")})
    with torch.no_grad():
        return model(x)


def test_each_sharded_chain_keeps_one_row_shard_across_steps(run, world):
    """G-SGD and G-Adam step a sharded chain through one RowShard, built on the first step
    and kept (its plan with it); Path-SGD and PSI keep none."""
    steppers = run["steppers"]
    for name in fw.SCENARIOS:
        chains = {"gsgd_normed": 1, "pathsgd_mlp": 0, "psi_normed": 0}.get(name, 1)
        assert steppers[name] == ["RowShard"] * chains + ["kept"], name


def test_sharded_twins_coincide(run, world):
    """A rescaled twin, sharded, trains to the same function (Theorem 3.6 under FSDP2),
    and the comparison sees a difference: the twin's weights are not the original's."""
    res = run
    x = fw.data(fw.mlp())[0]
    a, b = _function(res["gsgd_mlp"], x), _function(res["gsgd_twin"], x)
    assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        start = fw.build("gsgd_mlp")(x)
    assert not torch.allclose(a, start, atol=1e-3)  # training moved the function
    assert not torch.allclose(res["gsgd_mlp"]["param/0.weight"],
                              res["gsgd_twin"]["param/0.weight"], atol=1e-3)


def test_nan_on_one_process_skips_everywhere(run, world):
    """A NaN in the last process's local gradient: every process skips the step (weights
    and momentum bit for bit unchanged, one skip counted everywhere)."""
    nan = run["nan"]
    assert nan["skipped"] == [1] * world
    assert nan["warned"]
    for k, v in nan["before"].items():
        assert torch.equal(nan["after"][k], v), k


def test_skeleton_init_after_sharding(run, world):
    """skeleton_init_ on a sharded model initialises it as on the whole model."""
    torch.manual_seed(0)
    model = fw.conv()
    fw.skeleton_init_(model)
    got = run["init_after_sharding"]
    for n, p in model.named_parameters():
        assert torch.equal(got[f"param/{n}"], p.detach()), n


@pytest.mark.parametrize("world", [1, 2], scope="module")
def test_unsupported_layouts_are_refused(run, world):
    """A chain with some layers sharded and some not, a bias left whole among sharded
    layers, or weights split by columns (tensor parallelism), is refused when the optimizer
    is built, naming the parameter."""
    errors = run["errors"]
    assert "2.weight is a plain tensor in a chain" in errors["mixed"]
    assert "2.bias is a plain tensor in a chain whose other parameters" in errors["bias"]
    assert "0.weight is a DTensor placed (Shard(dim=1),)" in errors["columns"]
    assert "tensor parallelism" in errors["columns"]


def test_check_finite_raises_on_every_process(run, world):
    """check_finite=True and a NaN on one process: every process raises (none is left
    waiting in a collective), naming the parameter."""
    assert run["check_finite"] == ["non-finite gradient in 2.weight"] * world


def test_a_sharded_chains_skeleton_is_checked_at_the_first_step(run, world):
    """A default init is warned at its first step; a skeleton-initialised chain trained by
    G-Adam is "initialised, then trained", and no optimizer on it is warned."""
    got = run["skeleton"]
    assert len(got["default"]) == 1 and "skeleton_init_" in got["default"][0]
    assert got["trained"] == [] and got["states"] == ["trained", "trained"]


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
    fw.assert_close(fw.full_state(model, opt), ck["straight"])


@contextlib.contextmanager
def _as_rank(rank: int, world: int):
    """This process as ``rank`` of ``world`` on torch's fake process group, where
    collectives do nothing: what one rank holds and decides, seen in this process."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    with process_group("fake", fake_pg.FakeStore(), rank, world):
        yield


def _sharded(n: int, mesh, placements=None):
    """An ``n x 2`` DTensor whose entries count from 0, placed on ``mesh`` as given (by
    rows, as FSDP2 shards, by default)."""
    full = torch.arange(2.0 * n).reshape(n, 2)
    return distribute_tensor(full, mesh, placements or [Shard(0)], src_data_rank=None)


@pytest.mark.parametrize("n", [1, 2, 7, 8])
@pytest.mark.parametrize("world", [2, 3], scope="function")
def test_each_process_holds_the_rows_torch_chunk_gives_it(n, world):
    """row_range and local: rank r holds chunk r of ``torch.chunk`` (FSDP2's split), and
    ``(n, n)`` past the last chunk; its local rows are those rows."""
    chunks = torch.arange(n).chunk(world)
    for rank in range(world):
        with _as_rank(rank, world):
            w = _sharded(n, init_device_mesh("cpu", (world,)))
            r0, r1 = fsdp.row_range(w, "0.weight")
            want = (int(chunks[rank][0]), int(chunks[rank][-1]) + 1) if rank < len(chunks) \
                else (n, n)
            assert (r0, r1) == want, rank
            assert torch.equal(fsdp.local(w), torch.arange(2.0 * n).reshape(n, 2)[r0:r1])
            assert fsdp.row_ranges([w, w], ["a", "b"]) == (want, want)
    assert fsdp.local(w.to_local()) is not None and not fsdp.is_sharded(w.to_local())


def test_a_process_holding_other_rows_than_an_even_split_is_refused():
    # rank 2 of 4 should hold rows 4 to 6: the message gives their count, not where they start
    with _as_rank(2, 4):
        w = DTensor.from_local(torch.zeros(1, 2), init_device_mesh("cpu", (4,)), [Shard(0)],
                               run_check=False, shape=torch.Size([7, 2]), stride=(2, 1))
        with pytest.raises(ValueError, match=r"^0\.weight: this process holds 1 of its 7 "
                           r"rows, not the 2 of an even split over 4 processes$"):
            fsdp.row_range(w, "0.weight")
        with pytest.raises(ValueError, match=r"^2\.weight: this process holds 1 of its 7"):
            fsdp.row_ranges([_sharded(8, w.device_mesh), w], ["0.weight", "2.weight"])


def test_the_collectives_of_a_chain_go_over_its_meshs_process_group(monkeypatch):
    """A RowShard's sums and the finiteness of a DTensor are all-reduces over the mesh's
    own process group (a mesh of 2 of 4 processes is not the world), the finiteness flag
    reduced by its minimum."""
    calls = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, **kw: calls.append(kw))
    with _as_rank(1, 4):
        mesh = DeviceMesh("cpu", [0, 1])
        W = [_sharded(8, mesh), _sharded(4, mesh)]
        shard = fsdp.row_shard(Chain.mlp([2, 8, 4]), fsdp.row_ranges(W, ["a", "b"]), W[0])
        assert shard.rows == ((4, 8), (2, 4))
        v = np.zeros(3)
        assert shard.reduce(v) is v
        assert calls == [{"group": mesh.get_group()}]
        assert mesh.get_group() is not torch.distributed.group.WORLD
        calls.clear()
        assert fsdp.all_finite(W[0])
        assert calls == [{"op": torch.distributed.ReduceOp.MIN, "group": mesh.get_group()}]


def test_under_hsdp_rows_and_sums_follow_the_sharding_dimension(monkeypatch):
    """On a 2x2 mesh replicated over its first dimension and split by rows over its second
    (HSDP), rank r holds chunk r % 2 of the rows, a RowShard sums over the sharding
    dimension's group (its replica holds the same rows and sums its own), and finiteness
    is agreed over both dimensions (replicas skip together)."""
    calls = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, **kw: calls.append(kw))
    for rank in range(4):
        with _as_rank(rank, 4):
            mesh = init_device_mesh("cpu", (2, 2))
            W = [_sharded(n, mesh, [Replicate(), Shard(0)]) for n in (8, 5)]
            rows = fsdp.row_ranges(W, ["a", "b"])
            assert rows == (((0, 4), (0, 3)) if rank % 2 == 0 else ((4, 8), (3, 5))), rank
            r0, r1 = rows[0]
            assert torch.equal(fsdp.local(W[0]), torch.arange(16.0).reshape(8, 2)[r0:r1])
            calls.clear()
            fsdp.row_shard(Chain.mlp([2, 8, 5]), rows, W[0]).reduce(np.zeros(3))
            assert calls == [{"group": mesh.get_group(1)}]
            calls.clear()
            assert fsdp.all_finite(W[0])
            assert [c["group"] for c in calls] == [mesh.get_group(0), mesh.get_group(1)]


def test_every_layout_of_a_chain_but_rows_on_one_mesh_is_refused_naming_the_parameter():
    """check_chain: plain chains and chains sharded by rows on one mesh (1-D, or replicated
    over the other dimension of a 2-D one: HSDP) pass; a mix of plain and sharded, another
    placement (tensor parallelism's split over input units, a replicated DTensor, rows
    split over both dimensions, rows on one and input units on the other), two meshes or
    two sharding dimensions are refused."""
    names = ["0.weight", "2.weight"]
    with _as_rank(0, 4):
        mesh, hsdp = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
        rows, plain = _sharded(8, mesh), torch.zeros(8, 2)
        fsdp.check_chain([plain, plain], names)
        fsdp.check_chain([rows, _sharded(6, mesh)], names)
        replicated_rows = _sharded(8, hsdp, [Replicate(), Shard(0)])
        fsdp.check_chain([replicated_rows, _sharded(5, hsdp, [Replicate(), Shard(0)])], names)
        for params, message in [
                ([rows, plain], "2.weight is a plain tensor in a chain whose other parameters "
                                "FSDP2 shards: shard every layer of the chain (fully_shard on "
                                "each layer or on a module holding them)"),
                ([plain, rows], "0.weight is a plain tensor in a chain"),
                ([_sharded(8, mesh, [Shard(1)]), rows],
                 "0.weight is a DTensor placed (Shard(dim=1),) on a 1-D mesh, split over its "
                 "input units (tensor parallelism: RowwiseParallel, or Shard(1)): G-SGD "
                 "steps chains split by rows (Shard(0), the output units) over one mesh "
                 "dimension and replicated over any other (FSDP2's fully_shard, HSDP); "
                 "tensor parallelism is not supported"),
                ([rows, _sharded(8, mesh, [Replicate()])],
                 "2.weight is a DTensor placed (Replicate(),) on a 1-D mesh, replicated on "
                 "every process (a DTensor not split by rows)"),
                ([_sharded(8, hsdp, [Shard(0), Shard(0)])] * 2,
                 "0.weight is a DTensor placed (Shard(dim=0), Shard(dim=0)) on a 2-D mesh, "
                 "split otherwise than by rows over one mesh dimension"),
                # FSDP with tensor parallelism: rows over one dimension, input units over
                # the other, which is not a replica
                ([_sharded(8, hsdp, [Shard(0), Shard(1)])] * 2,
                 "0.weight is a DTensor placed (Shard(dim=0), Shard(dim=1)) on a 2-D mesh, "
                 "split over its input units (tensor parallelism: RowwiseParallel, or "
                 "Shard(1))"),
                ([rows, _sharded(8, DeviceMesh("cpu", [0, 1]))],
                 "2.weight lies on a different device mesh, or is split over another "
                 "dimension of it, from the chain's other parameters"),
                ([replicated_rows, _sharded(8, hsdp, [Shard(0), Replicate()])],
                 "2.weight lies on a different device mesh, or is split over another")]:
            with pytest.raises(ValueError) as info:
                fsdp.check_chain(params, names)
            assert str(info.value).startswith(message), str(info.value)
    assert str(info.value).endswith("parameters")  # whole messages: the first and the last


def test_a_non_finite_entry_of_a_sharded_array_is_found():
    """all_finite and every_finite on DTensors (each rank's own rows: the fake group's
    all-reduce leaves them alone) and on plain tensors."""
    with _as_rank(1, 2):
        w, plain = _sharded(4, init_device_mesh("cpu", (2,))), torch.ones(3)
        assert fsdp.all_finite(w) and fsdp.every_finite([plain, w])
        for bad in (float("nan"), float("inf")):
            w.to_local()[1, 0] = bad
            assert not fsdp.all_finite(w) and not fsdp.every_finite([plain, w])
            w.to_local()[1, 0] = 0.0
            plain[2] = bad
            assert not fsdp.all_finite(plain) and not fsdp.every_finite([plain, w])
            assert not fsdp.every_finite([torch.ones(2), plain])
            plain[2] = 1.0
        assert fsdp.all_finite(plain) and fsdp.every_finite([torch.ones(2), plain])


def test_a_step_handed_back_runs_on_the_full_arrays_and_each_rank_keeps_its_rows():
    """sharded_step: ``fast`` on the local rows; where it hands the step back (or is None),
    ``full`` on the whole arrays (nested lists and NamedTuples kept, None left), and each
    DTensor then holds its rows of what ``full`` wrote."""
    State = collections.namedtuple("State", "momentum step")
    with _as_rank(1, 3):
        mesh = init_device_mesh("cpu", (3,))
        w, plain = _sharded(7, mesh), torch.zeros(2)
        arrays = [[w, None], State(_sharded(7, mesh), plain)]
        seen = []

        def fast(local):
            seen.append(local)
            return len(seen) == 1

        def full(whole):
            assert isinstance(whole[1], State) and whole[0][1] is None
            assert whole[1].step is plain and whole[0][0].shape == (7, 2)
            whole[0][0].copy_(torch.arange(14.0).reshape(7, 2) + 100)
            whole[1].momentum.fill_(-1.0)
            plain.fill_(5.0)
            return "stepped"

        assert fsdp.sharded_step(arrays, fast, full) is True
        assert torch.equal(seen[0][0][0], w.to_local()) and seen[0][0][1] is None
        assert isinstance(seen[0][1], State) and seen[0][1].step is plain
        assert torch.equal(w.to_local(), torch.arange(6.0, 12.0).reshape(3, 2))  # untouched
        for fast_path in (fast, None):
            assert fsdp.sharded_step(arrays, fast_path, full) == "stepped"
            assert torch.equal(w.to_local(), torch.arange(6.0, 12.0).reshape(3, 2) + 100)
            assert torch.equal(arrays[1].momentum.to_local(), torch.full((3, 2), -1.0))
            assert torch.equal(plain, torch.full((2,), 5.0))
            w.to_local().zero_()


def test_a_sharded_chain_steps_its_own_rows_and_takes_no_backward_sums(one_process_group,
                                                                          monkeypatch):
    """G-SGD steps a chain FSDP2 shards on its local rows (the sharded kernels: the update
    of gathered layers never runs) and hooks none of its layers for column sums (those of
    local rows would be partial)."""
    import gsgd_adapters.torch.functional as optim

    def gathered(*args, **kwargs):
        raise AssertionError("the update of the gathered layers ran")

    monkeypatch.setattr(optim, "gsgd_update_", gathered)
    model = fw.shard(fw.build("gsgd_mlp"), init_device_mesh("cpu", (1,)))
    opt = fw.SCENARIOS["gsgd_mlp"][1](model)
    fw.train(model, opt, *fw.data(model), 3)
    assert opt.describe().column_sums == {} and opt.describe().skipped == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_step_handed_back_steps_the_gathered_layers(one_process_group, dtype):
    """The sharded kernels hand a half-precision step back: G-SGD then steps the gathered
    layers, bit for bit as on the unsharded model, and moves the weights."""
    plain = fw.build("gsgd_mlp").to(dtype)
    model = fw.shard(copy.deepcopy(plain), init_device_mesh("cpu", (1,)))
    x, y = (t.to(dtype) for t in fw.data(plain))
    runs = [(m, fw.SCENARIOS["gsgd_mlp"][1](m)) for m in (plain, model)]
    for m, opt in runs:
        fw.train(m, opt, x, y, 3)
    want, got = (fw.full_state(m, opt) for m, opt in runs)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert not torch.equal(want["param/2.weight"], fw.build("gsgd_mlp").to(dtype)[2].weight)


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


class _Block(torch.nn.Module):
    """A module of the user's (fx traces through it), holding a conv, and called with a
    keyword argument."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 2, 1)

    def forward(self, x, gelu=True):
        return (torch.nn.functional.gelu if gelu else torch.relu)(self.conv(x))


class _WithBlock(torch.nn.Sequential):
    def forward(self, x):
        h = self[1](self[0](x))
        h = self[2](h, gelu=False)
        return self[5](self[4](self[3](h)))


def test_discovery_sees_through_fully_shard_as_on_the_unsharded_model(one_process_group):
    """FSDP2 swaps each module's class for a subclass of its own: discovery still sees a
    Linear/Conv (a leaf, called once), QAT's conv (a leaf of torch.ao.nn), a user's block and
    a Sequential (traced through without FSDP's hooks), and finds what it finds unsharded."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from _catalogue import qat_conv
    from gsgd_adapters.torch import discover

    def build():
        torch.manual_seed(0)
        return _WithBlock(qat_conv(), torch.nn.ReLU(), _Block(), torch.nn.Sequential(
            torch.nn.Conv2d(2, 3, 1), torch.nn.ReLU()), torch.nn.Flatten(),
            torch.nn.Linear(48, 3))

    plain, sharded = build(), build()
    mesh = init_device_mesh("cpu", (1,))
    for m in reversed([*sharded.modules()][1:]):  # the innermost first
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear, _Block, torch.nn.Sequential)):
            fully_shard(m, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    want, got = discover(plain), discover(sharded)
    assert [c.names for c in want.chains] == [["0.4", "2.conv", "3.0", "5"]]
    assert [c.names for c in got.chains] == [["0.4", "2.conv", "3.0", "5"]]
    assert got.reasons == want.reasons == {
        "0.2": "torch.ao.nn.qat.modules.conv.Conv2d is a subclass of nn.Conv2d with a forward "
               "of its own",
        "0.0": "the next layer 0.2 cannot be in a chain"}
    assert isinstance(sharded[2], FSDPModule) and all(  # the trace gathered nothing
        isinstance(p, DTensor) for p in sharded.parameters())
    x = torch.randn(2, 2, 6, 6)
    torch.testing.assert_close(sharded(x), plain(x), rtol=0, atol=0)
