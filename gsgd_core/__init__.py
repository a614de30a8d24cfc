"""gsgd_core: G-SGD (Meng et al., ICLR 2019) and its relatives, written against the Array API.

The functional reference of the ``gsgd`` library: it imports no framework, resolves the array
namespace once per call, returns new arrays and never mutates its inputs, so the same code
runs on NumPy, PyTorch, JAX (under ``jit``), CuPy and array-api-strict.

Public names:

- the chain: ``Chain`` (``Chain.mlp``, ``Chain.from_shapes``);
- G-SGD: ``path_values``, ``icr``, ``gsgd_step``, ``gsgd_init``, ``gsgd_update``,
  ``GSGDState``;
- the rescaling group: ``rescale``, ``random_rescaling``, ``canonicalize``,
  ``skeleton_init``, ``weights_from_path_values``;
- PSI-SGD(M) (Yi et al., Algorithm 1): ``psi_init``, ``psi_update``, ``PSIState``;
- Path-SGD (Neyshabur et al. 2015): ``path_sgd_gamma``, ``path_sgd_step``;
- any rule in path space: ``path_init``, ``path_update``, ``allocate``, with the rules
  ``PathRule``, ``sgd_rule``, ``adam_rule``, ``adamw_rule`` (G-Adam(W), ...);
- ``gsgd_core.reference``: dense checks for small chains;
- ``gsgd_core.rules``: the numerics rules (numerics guide).
"""

from .chain import Chain
from .group import (canonicalize, random_rescaling, rescale, skeleton_init,
                    skeleton_state, weights_from_path_values)
from .gsgd import GSGDState, gsgd_init, gsgd_step, gsgd_update, icr, path_values
from .path_rules import (AdamRule, ElementwiseRule, PathRule, RuleState, SGDRule, adam_rule,
                         adamw_rule, sgd_rule)
from .path_sgd import path_sgd_gamma, path_sgd_step
from .path_space import allocate, path_init, path_update
from .psi import PSIState, psi_init, psi_update

__version__ = "0.1.0"
"""The version of the installed ``gsgd`` distribution."""

__all__ = [
    "AdamRule", "Chain", "ElementwiseRule", "GSGDState", "PSIState",
    "PathRule", "RuleState", "SGDRule", "__version__", "adam_rule", "adamw_rule", "allocate",
    "canonicalize", "gsgd_init", "gsgd_step", "gsgd_update", "icr", "path_init",
    "path_sgd_gamma", "path_sgd_step", "path_update", "path_values", "psi_init", "psi_update",
    "random_rescaling", "rescale", "sgd_rule", "skeleton_init", "skeleton_state",
    "weights_from_path_values",
]
