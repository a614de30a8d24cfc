"""G-SGD, G-Adam(W) and PSI-SGD(M) as ``keras.optimizers.Optimizer`` subclasses.

::

    model.compile(optimizer=GSGD(model, 0.01, momentum=0.9), loss=...)
    model.fit(x, y)

The optimizer finds the model's chains when it is constructed (:func:`.find_chains`) and
keeps them by variable path in its config, so ``model.save`` / ``keras.models.load_model``
rebuild it, state and all. Keras's own machinery runs around the step unchanged: learning
rate schedules, ``clipnorm`` / ``clipvalue`` / ``global_clipnorm``,
``gradient_accumulation_steps``, ``use_ema``, loss scaling; the JAX trainer traces the step
(``jit_compile``). The step (``_backend_update_step``) gives each chain the core's update in
path space (:mod:`gsgd_core`, Array API: the same code on JAX and torch arrays), each kernel
followed by batch normalisation PSI-SGD (``GSGD``, ``PSISGD``), and every other variable
Keras's own ``SGD`` (or ``Adam``) rule, including Keras's decoupled ``weight_decay``.
"""

from __future__ import annotations

import json
import warnings

import keras

from gsgd_core import adam_rule, adamw_rule, gsgd_init, gsgd_update, path_init, path_update
from gsgd_core import psi_init, psi_update

from .discovery import SKELETONS, Discovery, find_chains, key, make_chain
from .layout import KernelLayout
from .parts import Part, chain_part, row_part, state_arrays

__all__ = ["GAdam", "GAdamW", "GSGD", "PSISGD"]


def _claims(found: Discovery, skeleton: str) -> dict:
    """The claims of ``found`` by variable path: what an optimizer's config keeps."""
    return {"skeleton": skeleton, "chains": [c.spec() for c in found.chains],
            "normalised": {n: key(k) for n, k in found.normalised.items()},
            "reasons": dict(found.reasons)}


def _variable(by_path: dict, path: str, layer: str, known, name: str):
    if path not in by_path or (known is not None and id(by_path[path]) not in known):
        raise ValueError(
            f"layer {layer!r}: its variable {path!r} is not among the variables {name} is "
            "asked to train (an optimizer built for another model's variables?): create the "
            "optimizer with the model it trains")
    return by_path[path]


class _PathSpaceOptimizer(keras.optimizers.Optimizer):
    """The scaffold: claims, parts and their state, the rest rule. Subclasses give
    ``_chain_step(chain)``, ``_init_chain(chain, W, b)``, the rest rule's
    ``_build_rest(variables)`` (``None`` at variables of parts) and ``update_step``."""

    psi = False          # kernels followed by batch normalisation take PSI-SGD(M)
    chains = True        # chains take the path-space rule

    def __init__(self, model=None, learning_rate=0.01, *, skeleton: str = "he",
                 claims: dict | None = None, name: str | None = None, **kwargs):
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        if skeleton not in SKELETONS:
            raise ValueError(f"skeleton must be one of {SKELETONS}, got {skeleton!r}")
        self._known = None
        self._found = None
        if model is not None:
            self._found = find_chains(model, skeleton=skeleton)
            claims = _claims(self._found, skeleton)
            self._known = frozenset(id(v) for v in model.trainable_variables)
        elif claims is None:
            raise ValueError(f"{type(self).__name__} needs the model it trains: "
                             f"{type(self).__name__}(model, learning_rate, ...)")
        self.skeleton = skeleton
        self._claims_json = json.dumps(claims)

    # ------------------------------------------------------------------ building
    def _resolve(self, variables) -> Discovery:
        """The claims of the config, on these variables (by path)."""
        claims, by_path = json.loads(self._claims_json), {key(v): v for v in variables}
        get = lambda path, layer: _variable(by_path, path, layer, self._known, self.name)
        chains = []
        for spec in claims["chains"]:
            chains.append(make_chain(
                [s["layer"] for s in spec], [get(s["kernel"], s["layer"]) for s in spec],
                [None if s["bias"] is None else get(s["bias"], s["layer"]) for s in spec],
                [KernelLayout(s["before"], s["after"]) for s in spec], self.skeleton))
        normalised = {n: get(p, n) for n, p in claims["normalised"].items()}
        return Discovery(tuple(chains), normalised, claims["reasons"],
                         self._found.changes if self._found else {})

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        found = self._resolve(variables)
        self._found = found
        parts = []
        for c in found.chains if self.chains else ():
            parts.append(self._with_state(chain_part(c, self._chain_step(c.chain)),
                                          lambda W, b, c=c: self._init_chain(c.chain, W, b)))
        for n, k in found.normalised.items() if self.psi else ():
            parts.append(self._with_state(row_part(n, k, self._psi_step),
                                          lambda W, b: psi_init(W) if self.momentum else None))
        self._parts = tuple(parts)
        self._in_parts = frozenset(id(v) for p in parts for v in p.variables)
        self._build_rest([None if id(v) in self._in_parts else v for v in variables])

    def _with_state(self, part: Part, init) -> Part:
        """``part`` with its state: ``init(W, b)`` (the core's) held in new variables."""
        W, b = part.views({id(v): v.value for v in part.variables})
        part.template = init(W, b)
        part.slots = tuple(
            self.add_variable(tuple(a.shape), initializer="zeros",
                              dtype=keras.backend.standardize_dtype(a.dtype),
                              name=f"{part.name.split(' ')[0]}_{i}")
            for i, a in enumerate(state_arrays(part.template)))
        return part

    def _use_weight_decay(self, variable):
        # Chains decay their path values in the core; PSI rows are scale-invariant.
        if id(variable) in getattr(self, "_in_parts", ()):
            return False
        return super()._use_weight_decay(variable)

    def _apply_weight_decay(self, variables):
        # Keras's decoupled decay, on the variables outside the parts alone: Keras's torch
        # optimizer hands the ones it keeps to one torch._foreach_mul_, which refuses an
        # empty list (every variable in a chain or PSI).
        rest = [v for v in variables if self._use_weight_decay(v)]
        if rest:
            super()._apply_weight_decay(rest)

    # ------------------------------------------------------------------ the step
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        by_id = {id(v): keras.ops.cast(g, v.dtype) for g, v in zip(grads, trainable_variables)}
        done = set()
        for part in self._parts:
            if all(id(v) in by_id for v in part.variables):
                lr = keras.ops.cast(learning_rate, part.kernels[0].dtype)
                part.apply(self, by_id, lr)
                done.update(id(v) for v in part.variables)
        for g, v in zip(grads, trainable_variables):
            if id(v) not in done:
                self.update_step(g, v, learning_rate)

    # ------------------------------------------------------------------ reporting
    def describe(self) -> Discovery:
        """The chains, the kernels taking PSI-SGD and why every other layer with weights
        takes Keras's rule (``print(opt.describe())``)."""
        return self._found

    def get_config(self):
        with warnings.catch_warnings():
            # Keras reads the learning rate with Variable.numpy(), which NumPy 2 warns about.
            warnings.simplefilter("ignore", DeprecationWarning)
            config = super().get_config()
        config.update(skeleton=self.skeleton, claims=json.loads(self._claims_json))
        return config


@keras.saving.register_keras_serializable(package="gsgd")
class GSGD(_PathSpaceOptimizer):
    """G-SGD (Meng et al., ICLR 2019) for ``model.fit``: SGD on the values of a basis of
    paths, in every chain of ``model``.

    Parameters
    ----------
    model : keras.Model
        The built model this optimizer trains; its chains are found now
        (:func:`~gsgd_adapters.keras.find_chains`, ``print(opt.describe())`` says what and why).
    learning_rate : float or schedule
        As ``keras.optimizers.SGD``.
    momentum : float
        Momentum factor. In chains the buffer holds path gradients (``torch.optim.SGD``'s
        buffer convention, :func:`gsgd_core.gsgd_update`); elsewhere as Keras's SGD.
    nesterov : bool
        Nesterov momentum, in path space in chains; elsewhere as Keras's SGD.
    weight_decay : float, optional
        In chains, L2 on basis-path values (``D += weight_decay * V``); on variables outside
        chains and PSI, Keras's decoupled decay.
    bn : {"psi", "sgd"}
        Kernels without a bias followed by ``BatchNormalization`` take PSI-SGD(M) (Yi et
        al., Algorithm 1; ``"psi"``) or Keras's SGD (``"sgd"``).
    **kwargs
        ``skeleton`` (``"he"`` or ``"paper"``: the units of path values, the same as
        :func:`~gsgd_adapters.keras.skeleton_init`'s), and Keras's optimizer arguments:
        ``clipnorm``, ``clipvalue``, ``global_clipnorm``, ``use_ema``, ``ema_momentum``,
        ``ema_overwrite_frequency``, ``loss_scale_factor``, ``gradient_accumulation_steps``,
        ``name``.
    """

    psi = True

    def __init__(self, model=None, learning_rate=0.01, momentum: float = 0.0,
                 nesterov: bool = False, weight_decay=None, bn: str = "psi", **kwargs):
        super().__init__(model, learning_rate, weight_decay=weight_decay, **kwargs)
        if not isinstance(momentum, (int, float)) or not 0 <= momentum <= 1:
            raise ValueError(f"momentum must be a number in [0, 1], got {momentum!r}")
        if bn not in ("psi", "sgd"):
            raise ValueError(f"bn must be 'psi' or 'sgd', got {bn!r}")
        if nesterov and momentum == 0:
            raise ValueError("nesterov needs momentum > 0")
        self.momentum, self.nesterov, self.bn = float(momentum), bool(nesterov), bn
        self.psi = bn == "psi"

    def _chain_step(self, chain):
        hyper = dict(momentum=self.momentum, nesterov=self.nesterov,
                     weight_decay=self.weight_decay or 0.0)

        def step(state, W, b, G, Gb, lr):
            return gsgd_update(chain, state, W, b, G, Gb, lr=lr, **hyper)
        return step

    def _init_chain(self, chain, W, b):
        return gsgd_init(chain, W, b) if self.momentum else None

    def _build_rest(self, variables):
        # Keras's SGD (keras.optimizers.SGD.update_step) reads self.momentums by index.
        self.momentums = [None if v is None or not self.momentum
                          else self.add_variable_from_reference(v, "momentum")
                          for v in variables]

    update_step = keras.optimizers.SGD.update_step

    def _psi_step(self, state, W, b, G, Gb, lr):
        # PSI-SGD (no momentum) keeps no buffer: zero ones for the call, none kept.
        W2, new = psi_update(psi_init(W) if state is None else state, W, G, lr=lr,
                             momentum=self.momentum)
        return W2, [None], None if state is None else new

    def get_config(self):
        config = super().get_config()
        config.update(momentum=self.momentum, nesterov=self.nesterov, bn=self.bn)
        return config


@keras.saving.register_keras_serializable(package="gsgd")
class PSISGD(GSGD):
    """PSI-SGD(M) (Yi et al., Algorithm 1) for kernels followed by batch normalisation;
    every other variable (chains too) takes Keras's SGD. Arguments as :class:`GSGD`."""

    chains = False


@keras.saving.register_keras_serializable(package="gsgd")
class GAdam(_PathSpaceOptimizer):
    """G-Adam: Adam on basis-path values in every chain; Keras's Adam elsewhere.

    Parameters are ``keras.optimizers.Adam``'s, with ``model`` first and ``skeleton`` as
    :class:`GSGD`. In chains the moments are those of the path gradients
    (``torch.optim.Adam``'s arithmetic, :func:`gsgd_core.adam_rule`: ``epsilon`` added to
    the bias-corrected root) and ``weight_decay`` is L2 on path values (:class:`GAdamW`:
    decoupled); kernels followed by batch normalisation take Keras's Adam.
    """

    decoupled = False

    def __init__(self, model=None, learning_rate=0.001, beta_1: float = 0.9,
                 beta_2: float = 0.999, epsilon: float = 1e-7, amsgrad: bool = False,
                 weight_decay=None, **kwargs):
        super().__init__(model, learning_rate, weight_decay=weight_decay, **kwargs)
        self.beta_1, self.beta_2, self.epsilon, self.amsgrad = beta_1, beta_2, epsilon, amsgrad

    def _rule(self, lr):
        make = adamw_rule if self.decoupled else adam_rule
        return make(lr, (self.beta_1, self.beta_2), self.epsilon, self.weight_decay or 0.0,
                    self.amsgrad)

    def _chain_step(self, chain):
        def step(state, W, b, G, Gb, lr):
            return path_update(chain, self._rule(lr), state, W, b, G, Gb)
        return step

    def _init_chain(self, chain, W, b):
        return path_init(chain, self._rule(1.0), W, b)

    def _build_rest(self, variables):
        # Keras's Adam (keras.optimizers.Adam.update_step) reads these lists by index.
        def slots(name):
            return [None if v is None else self.add_variable_from_reference(v, name)
                    for v in variables]
        self._momentums, self._velocities = slots("momentum"), slots("velocity")
        if self.amsgrad:
            self._velocity_hats = slots("velocity_hat")

    update_step = keras.optimizers.Adam.update_step

    def get_config(self):
        config = super().get_config()
        config.update(beta_1=self.beta_1, beta_2=self.beta_2, epsilon=self.epsilon,
                      amsgrad=self.amsgrad)
        return config


@keras.saving.register_keras_serializable(package="gsgd")
class GAdamW(GAdam):
    """G-AdamW: as :class:`GAdam` with decoupled weight decay on path values
    (``Delta += lr * weight_decay * V``); Keras's AdamW elsewhere (default
    ``weight_decay=0.004``, Keras's)."""

    decoupled = True

    def __init__(self, model=None, learning_rate=0.001, weight_decay=0.004, **kwargs):
        super().__init__(model, learning_rate, weight_decay=weight_decay, **kwargs)
