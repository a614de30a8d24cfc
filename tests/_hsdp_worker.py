"""HSDP training runs (FSDP2's ``fully_shard`` on a 2x2 mesh: replicated over one dimension,
split by rows over the other), for tests/test_hsdp.py. The scenarios and models are those of
tests/_fsdp_worker.py."""

import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

import _fsdp_worker as fw

WORLD = 4
NAMES = ["gsgd_mlp", "gadam_mlp", "pathsgd_mlp"]


def worker(rank: int, world: int, init_file: str, out_file: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=90))
    try:
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
        if rank == 0:  # written whole, then renamed: the test reads it once it exists
            torch.save(results, out_file + ".part")
            os.replace(out_file + ".part", out_file)
    finally:
        dist.barrier()  # no process tears gloo down while another still talks
        dist.destroy_process_group()
