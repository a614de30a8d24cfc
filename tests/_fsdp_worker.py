"""FSDP2 (``fully_shard``) training runs of the optimizers, for tests/test_fsdp.py.

Spawned processes import this module; the test process builds the same models and runs
them on one process to compare. Every run is float64 and deterministic: the same seed
builds the same model everywhere, each process trains on its equal share of one batch
(FSDP2 averages the gradients, so the step sees the full batch's gradient).
"""

import functools
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from _gloo import gloo_worker
from gsgd_adapters.torch import GSGD, GAdam, GAdamW, PSISGD, PathSGD, skeleton_init_

F64 = dict(dtype=torch.float64)
BATCH = 12  # divisible by 2 and 3 processes
STEPS = 10


def mlp():
    # Widths 8, 7, 3 split unevenly over 3 processes (3+3+2, 3+3+1, 1+1+1).
    return nn.Sequential(nn.Linear(6, 8, **F64), nn.ReLU(), nn.Linear(8, 7, **F64), nn.ReLU(),
                         nn.Linear(7, 3, **F64))


def conv():
    # Over 3 processes the 2 output rows leave the last process none.
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, **F64), nn.ReLU(),
                         nn.Conv2d(4, 5, 3, padding=1, **F64), nn.ReLU(), nn.Flatten(),
                         nn.Linear(5 * 16, 2, **F64))


def normed():
    # Instance norm normalises each sample alone, so splitting the batch changes nothing.
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, **F64),
                         nn.InstanceNorm2d(4, affine=True, **F64), nn.ReLU(),
                         nn.Conv2d(4, 5, 3, padding=1, **F64), nn.ReLU(), nn.Flatten(),
                         nn.Linear(5 * 16, 2, **F64))


def rescaled(model):
    """``model`` (an :func:`mlp`) with its hidden units rescaled (same function)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for a, b in ((model[0], model[2]), (model[2], model[4])):
            c = torch.exp(torch.randn(a.out_features, generator=g, **F64))
            a.weight.mul_(c[:, None])
            a.bias.mul_(c)
            b.weight.div_(c[None, :])
    return model


#: name -> (model, optimizer, steps)
SCENARIOS = {
    "gsgd_mlp": (mlp, lambda m: GSGD(m, lr=0.05, momentum=0.9, nesterov=True,
                                     weight_decay=1e-3), STEPS),
    "gsgd_plain": (mlp, lambda m: GSGD(m, lr=0.05), STEPS),
    "gsgd_twin": (mlp, lambda m: GSGD(m, lr=0.05, momentum=0.9,
                                                          nesterov=True, weight_decay=1e-3),
                  STEPS),
    "gsgd_conv": (conv, lambda m: GSGD(m, lr=0.02, momentum=0.9), STEPS),
    "gsgd_conv_root": (conv, lambda m: GSGD(m, lr=0.02, momentum=0.9), STEPS),  # root only
    "gadam_mlp": (mlp, lambda m: GAdam(m, lr=1e-2, amsgrad=True), STEPS),
    "gadamw_conv": (conv, lambda m: GAdamW(m, lr=1e-2), STEPS),
    "pathsgd_mlp": (mlp, lambda m: PathSGD(m, lr=0.01), STEPS),
    "psi_normed": (normed, lambda m: PSISGD(m, lr=0.05, momentum=0.9), STEPS),
    "gsgd_normed": (normed, lambda m: GSGD(m, lr=0.05, momentum=0.9), STEPS),
}


def build(name: str):
    """The scenario's model, seeded and skeleton-initialised (before any sharding)."""
    torch.manual_seed(0)
    model = SCENARIOS[name][0]()
    skeleton_init_(model)
    return rescaled(model) if name == "gsgd_twin" else model


def data(model):
    """One batch for ``model`` (an :func:`mlp` or a conv net)."""
    g = torch.Generator().manual_seed(1)
    dense = isinstance(model[0], nn.Linear)
    return (torch.randn((BATCH, 6) if dense else (BATCH, 2, 4, 4), generator=g, **F64),
            torch.randn(BATCH, 3 if dense else 2, generator=g, **F64))


def train(model, opt, x, y, steps: int, poison=None) -> None:
    """``steps`` steps of the mean squared error; ``poison(step)`` runs after backward."""
    for step in range(steps):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        if poison is not None:
            poison(step)
        opt.step()


def shard(model, mesh, per_layer: bool = True):
    """``fully_shard`` on each Linear/Conv layer (unless ``per_layer`` is false) and at the
    root."""
    from torch.distributed.fsdp import fully_shard
    for m in model.modules():
        if per_layer and isinstance(m, (nn.Linear, nn.Conv2d)):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_state(model, opt) -> dict:
    """Every parameter and optimizer tensor gathered whole, by parameter name."""
    def whole(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t
    out = {f"param/{n}": whole(p.detach()).clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"state/{names[id(p)]}/{k}"] = whole(v).clone()
    return out


def one_process(name: str) -> dict:
    """The scenario trained on one process, unsharded: what the sharded runs must equal."""
    import warnings
    model = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = SCENARIOS[name][1](model)
    x, y = data(model)
    train(model, opt, x, y, SCENARIOS[name][2])
    return full_state(model, opt)


def assert_close(got: dict, want: dict, rtol: float = 1e-12) -> None:
    """Every tensor of ``got`` equals ``want``'s to ``rtol`` relative to its largest entry."""
    assert got.keys() == want.keys()
    for k, w in want.items():
        g = got[k]
        assert g.shape == w.shape and g.dtype == w.dtype, k
        scale = max(1.0, float(w.abs().max())) if w.is_floating_point() else 1.0
        err = float((g - w).abs().max()) if g.numel() else 0.0
        assert err <= rtol * scale, f"{k}: differs by {err:.3g} (scale {scale:.3g})"


def _local_batch(x, rank: int, world: int):
    n = x.shape[0] // world
    return x[rank * n:(rank + 1) * n]


def worker(rank: int, world: int, init_file: str, out_dir: str, ckpt_dir: str) -> None:
    gloo_worker(rank, world, init_file, os.path.join(out_dir, f"world{world}.pt"),
                functools.partial(_world_runs, ckpt_dir=ckpt_dir))


def _world_runs(rank: int, world: int, ckpt_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    return sharded_runs(rank, world, init_device_mesh("cpu", (world,)), ckpt_dir)


def sharded_runs(rank: int, world: int, mesh, ckpt_dir: str = "") -> dict:
    """Every scenario and check on this process's share, sharded over ``mesh``: what
    tests/test_fsdp.py compares with one process."""
    results = {"steppers": {}}  # per scenario: what steps its chains, kept or rebuilt
    for name, (_, make_opt, steps) in SCENARIOS.items():
        model = shard(build(name), mesh, per_layer=not name.endswith("_root"))
        opt = make_opt(model)
        x, y = (_local_batch(t, rank, world) for t in data(model))
        train(model, opt, x, y, 1)
        first = dict(opt.__dict__.get("_steppers", {}))
        train(model, opt, x, y, steps - 1)
        results[name] = full_state(model, opt)
        results["steppers"][name] = [type(s).__name__ for s in first.values()] + [
            "kept" if all(opt._steppers[k] is s for k, s in first.items()) else "rebuilt"]
    results["nan"] = _nan_run(rank, world, mesh)
    results["errors"] = _errors(mesh)
    results["check_finite"] = _check_finite_run(rank, world, mesh)
    results["skeleton"] = _skeleton_run(rank, world, mesh)
    torch.manual_seed(0)
    late = shard(conv(), mesh)
    skeleton_init_(late)  # on the sharded model: the gathered layers, rows written back
    results["init_after_sharding"] = {f"param/{n}": p.detach().full_tensor()
                                      for n, p in late.named_parameters()}
    if ckpt_dir:
        results["checkpoint"] = _checkpoint_run(rank, world, mesh, ckpt_dir)
    return results


def _nan_run(rank, world, mesh) -> dict:
    """A NaN in one process's local gradient at step 3: every process skips that step."""
    model = shard(build("gsgd_mlp"), mesh)
    opt = GSGD(model, lr=0.05, momentum=0.9)
    x, y = (_local_batch(t, rank, world) for t in data(model))
    before = {}

    def poison(step):
        if step == 3:
            before.update(full_state(model, opt))
            if rank == world - 1:
                model[2].weight.grad.to_local()[0, 0] = float("nan")

    def record(step):
        poison(step)

    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, opt, x, y, 4, poison=record)
    after = full_state(model, opt)
    skipped = torch.tensor([opt.describe().skipped], dtype=torch.int64)
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(counts, skipped)
    return dict(before=before, after=after, skipped=[int(c) for c in counts],
                warned=any("skipped" in str(w.message) for w in caught))


def _skeleton_run(rank, world, mesh) -> dict:
    """What the optimizers of a sharded chain say of its skeleton: the SkeletonWarnings of a
    default init's first step, and, after skeleton_init_ and training, those of the training
    and of a second optimizer, with each optimizer's chain states."""
    import warnings
    from gsgd_adapters.torch import SkeletonWarning
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        GAdam(shard(mlp(), mesh), lr=0.01).step()
        out["default"] = [str(w.message) for w in caught if w.category is SkeletonWarning]
        del caught[:]
        model = shard(build("gsgd_mlp"), mesh)
        x, y = (_local_batch(t, rank, world) for t in data(model))
        opts = [GAdam(model, lr=0.01), GSGD(model, lr=0.05)]
        for opt in opts:
            train(model, opt, x, y, 2)
        out["trained"] = [str(w.message) for w in caught if w.category is SkeletonWarning]
    out["states"] = [p.skeleton_state for opt in opts for p in opt.describe().parts
                     if p.kind == "chain"]
    return out


def _checkpoint_run(rank, world, mesh, ckpt_dir) -> dict:
    """5 steps, a DCP save, 5 more; then a fresh model and optimizer loaded from the
    checkpoint take the same 5 steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    name = "gsgd_mlp"
    model = shard(build(name), mesh)
    x, y = (_local_batch(t, rank, world) for t in data(model))
    opt = SCENARIOS[name][1](model)
    train(model, opt, x, y, 5)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir)
    saved = full_state(model, opt)
    train(model, opt, x, y, 5)
    straight = full_state(model, opt)

    torch.manual_seed(123)  # a different model: everything must come from the checkpoint
    fresh = shard(SCENARIOS[name][0](), mesh)
    opt2 = SCENARIOS[name][1](fresh)
    msd, osd = get_state_dict(fresh, opt2)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=ckpt_dir)
    set_state_dict(fresh, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    loaded = full_state(fresh, opt2)
    train(fresh, opt2, x, y, 5)
    return dict(saved=saved, straight=straight, loaded=loaded,
                resumed=full_state(fresh, opt2))


def _refusal(model) -> str:
    """The ``ValueError`` GSGD raises when built on ``model`` (``""`` if it is built)."""
    try:
        GSGD(model, lr=0.1)
    except ValueError as exc:
        return str(exc)
    return ""


def _errors(mesh) -> dict:
    """What the optimizers say about layouts they cannot step."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    mixed = build("gsgd_mlp")
    fully_shard(mixed[0], mesh=mesh)  # the other layers stay plain tensors
    bias = build("gsgd_mlp")
    for m in (bias[0], bias[2], bias[4]):  # 2.bias stays whole: ignored by FSDP2
        fully_shard(m, mesh=mesh, ignored_params={m.bias} if m is bias[2] else None)
    columns = build("gsgd_mlp")
    for m in (columns[0], columns[2], columns[4]):  # tensor parallel: columns split
        m.weight = nn.Parameter(distribute_tensor(m.weight.detach(), mesh, [Shard(1)]))
        m.bias = nn.Parameter(distribute_tensor(m.bias.detach(), mesh, [Shard(0)]))
    return {k: _refusal(model) for k, model in
            dict(mixed=mixed, bias=bias, columns=columns).items()}


def _check_finite_run(rank, world, mesh) -> list:
    """check_finite=True with a NaN in the last process's rows: what each process raised."""
    model = shard(build("gsgd_mlp"), mesh)
    opt = GSGD(model, lr=0.1, check_finite=True)
    x, y = (_local_batch(t, rank, world) for t in data(model))
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    if rank == world - 1:
        model[2].weight.grad.to_local()[0, 0] = float("nan")
    try:
        opt.step()
        message = ""
    except ValueError as exc:
        message = str(exc)
    out = [None] * world
    dist.all_gather_object(out, message)
    return out
