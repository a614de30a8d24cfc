"""A jaxpr flattened into one list of equations, with the calls it can see through inlined.

``jax.make_jaxpr`` nests the bodies of ``jit`` / ``pjit``, ``custom_jvp_call`` (``jax.nn.relu``
is one), ``custom_vjp_call``, ``closed_call`` and ``remat``; their forward semantics is their
body, so discovery reads one flat, topologically ordered program. Every value gets its own
:class:`Value` (a body inlined twice gets fresh values each time), and each equation remembers
the names of the calls it came from, for the reasons a user reads. ``vmap`` leaves no call of
its own: its batching rules are already applied in the traced equations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

# Call primitives whose body is their forward function (names across jax versions).
INLINED = {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
           "custom_vjp_call_jaxpr", "remat", "remat2", "checkpoint"}
# Ops through which an all-zero constant stays all zero (dropout's and where's zeros).
_ZERO_PRESERVING = {"convert_element_type", "broadcast_in_dim", "reshape", "squeeze",
                    "transpose", "copy"}


class Value:
    """One value of the flattened program: its shape, whether it is a constant
    (computed from literals and the jaxpr's constants alone), a known all-zero one, and
    the value itself where it is a scalar constant (``scalar``; else ``None``)."""

    __slots__ = ("shape", "const", "zero", "scalar")

    def __init__(self, aval, const: bool = False, zero: bool = False, scalar=None) -> None:
        self.shape = tuple(getattr(aval, "shape", ()))   # a token has none
        self.const = const
        self.zero = zero
        self.scalar = scalar

    def __repr__(self) -> str:
        return f"Value{self.shape}"


@dataclass
class Eqn:
    """One primitive application: its name, inputs, outputs, parameters and the names of
    the calls around it (outermost first)."""

    prim: str
    ins: tuple
    outs: tuple
    params: dict
    where: tuple = ()

    def describe(self) -> str:
        inside = f" (inside {'/'.join(self.where)})" if self.where else ""
        return f"{self.prim}{inside}"


@dataclass
class Program:
    """The flattened program: equations in order, the inputs and outputs, who uses what."""

    inputs: list
    outputs: list
    eqns: list
    users: dict = field(default_factory=dict)      # Value -> indices of the eqns reading it
    producer: dict = field(default_factory=dict)   # Value -> index of the eqn writing it
    #: the values that reach any of the outputs (:meth:`reaching`), once per program:
    #: every layer's walk reads them
    live: set = field(init=False)

    def __post_init__(self) -> None:
        for i, e in enumerate(self.eqns):
            for v in e.ins:
                self.users.setdefault(v, []).append(i)
            for v in e.outs:
                self.producer[v] = i
        self.live = self.reaching(self.outputs)

    def reaching(self, outputs) -> set:
        """The values from which some of ``outputs`` can be reached: the others are dead
        code (``jax.make_jaxpr`` keeps it), which cannot change them."""
        live = set(outputs)
        for e in reversed(self.eqns):
            if any(v in live for v in e.outs):
                live.update(e.ins)
        return live


def _const(aval, x) -> Value:
    """A literal or one of the jaxpr's constants: whether it is all zeros, and its value
    where it is a scalar (a typed PRNG key has no NumPy value: neither)."""
    try:
        a = np.asarray(x)
        zero = bool(np.all(a == 0))
    except (TypeError, ValueError):
        return Value(aval, True)
    return Value(aval, True, zero, a if a.ndim == 0 else None)


def _folded(eqn, ins: list) -> list:
    """The scalars an equation of scalar constants computes (a shape's count, ``jnp.var``'s
    test of it, a loop's count), one per output, or ``None`` for each: such values are fixed
    when the model is traced."""
    unknown = [None] * len(eqn.outvars)
    if any(v.scalar is None for v in ins) or any(  # a token has no shape
            getattr(v.aval, "shape", None) != () for v in eqn.outvars):
        return unknown
    try:
        out = eqn.primitive.bind(*[v.scalar for v in ins], **eqn.params)
        return [np.asarray(o) for o in (out if eqn.primitive.multiple_results else [out])]
    except Exception:  # noqa: BLE001 - what cannot run eagerly, or has no NumPy value (a key)
        return unknown


def _body(eqn):
    """The body of a call equation that is its forward function, or ``None``."""
    if eqn.primitive.name not in INLINED:
        return None
    for value in eqn.params.values():
        if isinstance(value, ClosedJaxpr):
            body, consts = value.jaxpr, value.consts
        elif isinstance(value, Jaxpr):
            body, consts = value, ()
        else:
            continue
        if len(body.invars) == len(eqn.invars) and len(body.outvars) == len(eqn.outvars):
            return body, consts
    return None


def _inline(jaxpr: Jaxpr, consts, in_values: list, out: list, where: tuple) -> list:
    env = {v: _const(v.aval, c) for v, c in zip(jaxpr.constvars, consts)}
    env.update(zip(jaxpr.invars, in_values))

    def read(atom):
        return _const(atom.aval, atom.val) if isinstance(atom, Literal) else env[atom]

    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        body = _body(eqn)
        if body is not None:
            name = eqn.params.get("name", eqn.primitive.name)
            outs = _inline(body[0], body[1], ins, out, where + (str(name),))
        else:
            const = all(v.const for v in ins) and not eqn.effects
            zero = eqn.primitive.name in _ZERO_PRESERVING and bool(ins) and ins[0].zero
            scalars = _folded(eqn, ins) if const else [None] * len(eqn.outvars)
            outs = [Value(v.aval, const, zero, x) for v, x in zip(eqn.outvars, scalars)]
            out.append(Eqn(eqn.primitive.name, tuple(ins), tuple(outs), dict(eqn.params), where))
        env.update(zip(eqn.outvars, outs))
    return [read(a) for a in jaxpr.outvars]


def flatten(closed: ClosedJaxpr) -> Program:
    """The :class:`Program` of a traced function (``jax.make_jaxpr``'s result)."""
    inputs = [Value(v.aval) for v in closed.jaxpr.invars]
    eqns: list = []
    outputs = _inline(closed.jaxpr, closed.consts, inputs, eqns, ())
    return Program(inputs, outputs, eqns)
