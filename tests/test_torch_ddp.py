"""DDP + GSGD/GAdam on two CPU processes equals one process on the same global batch, with
the chains' column sums from the backward pass averaged over the processes."""

import pytest
import torch

import _ddp_worker as dw
from _helpers import DEFAULT_INIT, spawn_workers

pytestmark = [DEFAULT_INIT, pytest.mark.skipif(not torch.distributed.is_available(),
                                               reason="torch.distributed missing")]

WORLD = 2
ONE_PASS = {"backward": dw.STEPS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every scenario of the workers, run once on two spawned processes."""
    tmp = tmp_path_factory.mktemp("ddp")
    out = tmp / "runs.pt"
    spawn_workers(dw.worker, (WORLD, str(tmp / "init"), str(out)), WORLD, out, limit=150)
    return torch.load(out, weights_only=True)


def _one_process(name: str, rank: int | None = None) -> dict:
    """The scenario's optimizer on one process over the whole batch (or over process
    ``rank``'s half of it)."""
    model, x, y = dw.model_and_data()
    if rank is not None:
        x, y = x[rank::WORLD], y[rank::WORLD]
    dw.train(model, dw.optimizer(dw.SCENARIOS[name][1], model), x, y)
    return model.state_dict()


def _assert_close(got: dict, want: dict) -> None:
    for name, p in want.items():
        err = float((got[name] - p).abs().max())
        assert err <= 1e-12 * max(1.0, float(p.abs().max())), f"{name}: differs by {err:.3g}"


@pytest.mark.parametrize("name", ["plain", "gadam", "accumulate", "bucket_view",
                                  "find_unused"])
def test_ddp_steps_take_the_backward_sums_and_equal_one_process(runs, name):
    """Each process's steps take the column sums from the backward pass, averaged over the
    processes, and both processes equal one process on the whole batch to 1e-12: plain
    DDP, G-Adam, gradients accumulated under no_sync over two micro-batches (also with
    gradients as views of DDP's buckets), find_unused_parameters."""
    run, want = runs[name], _one_process(name)
    assert run["counts"] == [ONE_PASS] * WORLD
    for state in run["states"]:
        _assert_close(state, want)


def test_gradients_kept_as_views_of_ddps_buckets_equal_one_process(runs):
    """Gradients kept as views of DDP's buckets (zeroed in place) share one version counter
    per bucket, so an accumulation into one looks like a change of the others: those steps
    read W * grad, and every step equals one process."""
    run = runs["bucket_view_kept"]
    for counts, state in zip(run["counts"], run["states"]):
        assert sum(counts.values()) == dw.STEPS
        _assert_close(state, _one_process("bucket_view_kept"))


def test_a_communication_hook_refuses_the_backward_sums(runs):
    """A communication hook of the user's reduces the gradients (it need not average them):
    every step reads W * grad instead, says why, and equals one process."""
    run = runs["comm_hook"]
    why = ("DDP's communication hook allreduce_hook reduces the gradients (the column sums "
           "follow DDP's own all-reduce only)")
    assert run["counts"] == [{why: dw.STEPS}] * WORLD
    for state in run["states"]:
        _assert_close(state, _one_process("comm_hook"))


def test_sums_invalid_on_one_process_are_refused_on_every_process(runs):
    """The second process changes a gradient in place between two micro-batches: its
    record stops (its sums are partial), and the first process, whose own record is
    valid, refuses the averaged sums too; both equal one process."""
    run = runs["edited_on_one"]
    assert run["counts"] == [
        {"the column sums were refused on another process": dw.STEPS},
        {"the gradient was changed after a backward pass": dw.STEPS}]
    for state in run["states"]:
        _assert_close(state, _one_process("edited_on_one"))


def test_steps_after_no_sync_alone_keep_each_processs_own_sums(runs):
    """Every backward pass under no_sync: DDP reduces nothing, each process steps on its
    own gradients (as torch's SGD would), so its sums are not averaged: each process equals
    one process on its own half of the batch."""
    run = runs["no_sync_only"]
    assert run["counts"] == [{"the last backward pass ran under DDP's no_sync": dw.STEPS}
                             ] * WORLD
    for rank, state in enumerate(run["states"]):
        _assert_close(state, _one_process("no_sync_only", rank))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_each_step_all_reduces_the_sums_once_over_ddps_group(one_process_group, monkeypatch,
                                                             dtype):
    """One all-reduce per step over DDP's process group, of one flag per chain and every
    layer's sums and bound: 1 + (8 + 5) + 3 numbers for the MLP 6-8-5-3, in the model's
    dtype (a world of one, in this process)."""
    import torch.distributed as dist
    from gsgd_adapters.torch import GSGD

    model, x, y = dw.model_and_data()
    model, x, y = model.to(dtype), x.to(dtype), y.to(dtype)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = GSGD(ddp, lr=0.05)
    calls, all_reduce = [], dist.all_reduce

    def spy(t, *args, **kwargs):
        calls.append((t.numel(), t.dtype, kwargs.get("group")))
        return all_reduce(t, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", spy)
    dw.train(ddp, opt, x, y)
    assert calls == [(17, dtype, ddp.process_group)] * dw.STEPS
    assert opt.describe().column_sums == ONE_PASS


class _TwoChains(torch.nn.Module):
    """Two MLPs, one of which each forward pass runs."""

    def __init__(self):
        super().__init__()
        self.a, self.b = dw.model_and_data()[0], dw.model_and_data()[0]

    def forward(self, x, which: str):
        return getattr(self, which)(x)


def _edit_then_other_chain(wrap) -> tuple[dict, dict]:
    """A backward pass through chain b, the gradient of b's last layer doubled in place, a
    backward pass through chain a, one step: the weights and where the steps got their
    column sums."""
    from gsgd_adapters.torch import GSGD

    model = _TwoChains()
    _, x, y = dw.model_and_data()
    net = wrap(model)
    opt = GSGD(net, lr=0.05, chains=[[m[i] for i in (0, 2, 4)] for m in (model.a, model.b)])
    opt.zero_grad()
    ((net(x, "b") - y) ** 2).mean().backward()
    with torch.no_grad():
        model.b[4].weight.grad.mul_(2)
    ((net(x, "a") - y) ** 2).mean().backward()
    opt.step()
    return model.state_dict(), dict(opt.describe().column_sums)


def test_a_gradient_changed_after_its_backward_pass_stays_refused_after_another(
        one_process_group):
    """A gradient changed in place after the backward pass that reached it is still
    refused after a later backward pass that reached another chain only: the step reads
    W * grad there, as without DDP, and equals the step without DDP."""
    ddp = lambda m: torch.nn.parallel.DistributedDataParallel(m, find_unused_parameters=True)
    state, counts = _edit_then_other_chain(ddp)
    alone, counts_alone = _edit_then_other_chain(lambda m: m)
    assert counts == counts_alone == {"backward": 1,
                                      "the gradient was changed after a backward pass": 1}
    _assert_close(state, alone)


def test_a_forward_pass_without_grad_keeps_ddps_no_sync_decision(one_process_group):
    """An evaluation forward pass (no grad) between a forward pass under no_sync and its
    backward pass leaves DDP's decision as it was: the gradients were not reduced, and the
    step says so and reads W * grad."""
    from gsgd_adapters.torch import GSGD

    model, x, y = dw.model_and_data()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = GSGD(ddp, lr=0.05)
    with ddp.no_sync():
        out = ddp(x)
    with torch.no_grad():
        ddp(x)
    ((out - y) ** 2).mean().backward()
    opt.step()
    assert opt.describe().column_sums == {"the last backward pass ran under DDP's no_sync": 1}


def test_a_copy_of_the_ddp_model_runs_without_the_optimizer(one_process_group):
    """A copy of the DDP model (an evaluation twin) runs its forward pass; the optimizer's
    record stays with the original."""
    import copy

    from gsgd_adapters.torch import GSGD

    model, x, y = dw.model_and_data()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = GSGD(ddp, lr=0.05)
    twin = copy.deepcopy(ddp)
    torch.testing.assert_close(twin(x), ddp(x))
    dw.train(ddp, opt, x, y)
    assert opt.describe().column_sums == ONE_PASS


def test_without_backward_sums_a_ddp_model_steps_as_one_process(one_process_group):
    """``backward_sums=False``: nothing to average over DDP's processes, and every step reads
    ``W * grad`` as the optimizer of the module alone does."""
    import copy

    from gsgd_adapters.torch import GSGD

    model, x, y = dw.model_and_data()
    alone = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = GSGD(ddp, lr=0.05, backward_sums=False)
    dw.train(ddp, opt, x, y)
    dw.train(alone, GSGD(alone, lr=0.05, backward_sums=False), x, y)
    _assert_close(model.state_dict(), alone.state_dict())
    assert opt.describe().column_sums == {}
