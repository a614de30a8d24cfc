"""The body of the spawned gloo workers of the multi-process tests (DDP, FSDP2, HSDP): a
module of its own, light to import in each spawned process."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def gloo_worker(rank: int, world: int, init_file: str, out_file: str, run,
                timeout: float = 90.0) -> None:
    """The body of a spawned worker: this process as ``rank`` of a gloo group of ``world``
    (rendezvous through ``init_file``, one thread), ``run(rank, world)``'s results saved by
    rank 0 to ``out_file`` (written whole, then renamed: the test reads it once it exists),
    and the group destroyed once every process is done talking."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout))
    try:
        results = run(rank, world)
        if rank == 0:
            torch.save(results, out_file + ".part")
            os.replace(out_file + ".part", out_file)
    finally:
        dist.barrier()  # no process tears gloo down while another still talks
        dist.destroy_process_group()
