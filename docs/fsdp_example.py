# torchrun --nproc_per_node 2 docs/fsdp_example.py   (from the repository root, CPU)
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from gsgd_adapters.torch import GSGD, skeleton_init_

dist.init_process_group("gloo")                     # "nccl" on GPUs
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)                                # the same model on every process
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                      nn.Linear(256, 10))
skeleton_init_(model)                               # before sharding, or after it
for layer in (model[0], model[2], model[4]):
    fully_shard(layer, mesh=mesh)                   # each layer's rows split over processes
fully_shard(model, mesh=mesh)
opt = GSGD(model, lr=0.05, momentum=0.9)            # GAdam, GAdamW, PSISGD, PathSGD alike
if dist.get_rank() == 0:
    print(opt.describe())                           # no collective: fine on one process

torch.manual_seed(1 + dist.get_rank())              # this process's share of the data
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
for _ in range(3):
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()                                      # local rows; one all-reduce of O(widths)

model_sd, optim_sd = get_state_dict(model, opt)     # sharded weights and momentum buffers
dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id="gsgd_checkpoint")
state = {"model": model_sd, "optim": optim_sd}
dcp.load(state, checkpoint_id="gsgd_checkpoint")    # into the same or a new model
set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
dist.destroy_process_group()
