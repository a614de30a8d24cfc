"""HSDP training runs (FSDP2's ``fully_shard`` on a 2x2 mesh: replicated over one dimension,
split by rows over the other), for tests/test_hsdp.py. The scenarios and models are those of
tests/_fsdp_worker.py."""

import functools
import warnings

import _fsdp_worker as fw
from _gloo import gloo_worker

WORLD = 4
NAMES = ["gsgd_mlp", "gadam_mlp", "pathsgd_mlp"]


def runs(rank: int, world: int) -> dict:
    """Each scenario of :data:`NAMES` on this process's share, and check_finite's errors."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    results = {"placements": {}}
    for name in NAMES:
        model = fw.shard(fw.build(name), mesh)
        results["placements"][name] = [str(tuple(p.placements)) for p in model.parameters()]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = fw.SCENARIOS[name][1](model)
        x, y = (fw._local_batch(t, rank, world) for t in fw.data(model))
        fw.train(model, opt, x, y, fw.SCENARIOS[name][2])
        results[name] = fw.full_state(model, opt)
    results["check_finite"] = fw._check_finite_run(rank, world, mesh)
    return results


worker = functools.partial(gloo_worker, run=runs)
