"""``torch.optim`` optimizers over the gsgd core: G-SGD, G-Adam(W), PSI-SGD(M) and Path-SGD.

    from gsgd_adapters.torch import GSGD, skeleton_init_
    skeleton_init_(model)               # once, before training (skeleton guide)
    opt = GSGD(model, lr=0.1, momentum=0.9)   # the rest of the training loop is unchanged
    print(opt.describe())
"""

from .adam import GAdam, GAdamW
from .discovery import ChainLayers, chain_of, discover
from .groups import Description
from .model_ops import check_invariance, random_rescale_, skeleton_init_
from .optim import GSGD, PSISGD, PathSGD, SkeletonWarning, SkippedStepWarning

__all__ = ["GAdam", "GAdamW", "GSGD", "PSISGD", "PathSGD", "ChainLayers", "Description",
           "SkeletonWarning", "SkippedStepWarning", "chain_of", "check_invariance", "discover",
           "random_rescale_", "skeleton_init_"]
