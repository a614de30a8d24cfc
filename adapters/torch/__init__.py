"""``torch.optim`` optimizers over the gsgd core: G-SGD, G-Adam(W), PSI-SGD(M) and Path-SGD.

Examples
--------
>>> import torch
>>> from torch import nn
>>> from gsgd_adapters.torch import GSGD, skeleton_init_
>>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(),
...                       nn.Linear(8, 3))
>>> chains = skeleton_init_(model)     # once, before training
>>> opt = GSGD(model, lr=0.1, momentum=0.9)
>>> print(opt.describe())
G-SGD: 1 chain(s), m=67, H=8, G-space dim=59, invariant ratio
H/m=0.1194
  chain 0 -> 2: Chain(4 -> 8 -> 3, skeleton_scale=[0.707, 0.433];
  m=67, H=8, G-space dim=59, H/m=0.119); skeleton initialised (he);
  lr=0.1, momentum=0.9, weight_decay=0
>>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
>>> nn.functional.cross_entropy(model(x), y).backward()
>>> opt.step()                      # the loop is otherwise unchanged
>>> opt.zero_grad()
"""

from .adam import GAdam, GAdamW
from .discovery import ChainLayers, chain_of, discover
from .description import Description
from .model_ops import check_invariance, random_rescale_, skeleton_init_
from .optim import GSGD, PSISGD, PathSGD, SkeletonWarning, SkippedStepWarning

__all__ = ["GAdam", "GAdamW", "GSGD", "PSISGD", "PathSGD", "ChainLayers", "Description",
           "SkeletonWarning", "SkippedStepWarning", "chain_of", "check_invariance", "discover",
           "random_rescale_", "skeleton_init_"]
