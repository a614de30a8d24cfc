"""Run by test_jax_mesh.py in a process of its own, whose XLA_FLAGS give JAX 4 host devices
(set before JAX starts, so not in the test process). Prints one JSON object:

- ``errors[layout][what]``: the largest relative difference, over the leaves, between the
  params trained on the mesh and on one device (``what``: a transformation after several
  steps under ``jax.jit``, or ``init``: ``skeleton_init`` then ``random_rescale``);
- ``misplaced[layout][what]``: the key paths of the arrays of transformation ``what``'s
  ``opt.init`` under ``jax.jit`` (no ``out_shardings``) placed otherwise than by an eager
  ``init`` (each buffer as the leaf it belongs to), or step counts not over the mesh;
  ``misplaced["eager G-Adam"]``: those of G-Adam's eager ``init`` on the FSDP layout;
- ``state_bytes[layout][what]``: the most bytes of each transformation's state (made under
  ``jit``) on one device, next to the params' (``params``);
- ``refused[case]``: the ``ValueError`` each bad placement raised (``None``: none), and
  ``fsdp_eager`` the one the core's validation raised for an FSDP layout, ``uncommitted``
  the one an uncommitted leaf outside the chains raised beside the mesh's (none expected
  for either);
- ``collectives[layout/transformation]``: the arrays an update moves between devices, and
  how many of them are weight-sized.
"""

from __future__ import annotations

import functools
import json
import sys

import jax
import numpy as np
import optax

jax.config.update("jax_enable_x64", True)

from gsgd_adapters.jax import random_rescale, skeleton_init  # noqa: E402
from gsgd_adapters.jax.leaves import key_paths  # noqa: E402
from gsgd_core.arrays import prepare  # noqa: E402
from gsgd_adapters.optax import InPathSpaceState, gsgd, in_path_space, path_sgd, psi_sgd  # noqa: E402,E501
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402
from _jax_mesh import COLLECTIVES, LAYOUTS, TRANSFORMS, loss_fn, mesh, model, place  # noqa: E402
from benchmarks.jax_mesh import collectives, weight_sized  # noqa: E402

STEPS = 3


ADAM = optax.adam(1e-2)      # G-Adam's inner transformation


def optimizers(chains):
    kernels = [w for c in chains for w in c.weights]
    return {"gsgd": gsgd(0.05, chains, momentum=0.9, weight_decay=1e-3),
            "psi_sgd": psi_sgd(0.05, kernels, momentum=0.9),
            "path_sgd": path_sgd(0.01, chains),
            "in_path_space": in_path_space(ADAM, chains)}


def trainer(module, chains, names):
    """One jitted function: skeleton init and a rescaling, then ``STEPS`` steps of each
    transformation in ``names`` from there (``opt.init`` traced inside it too)."""
    loss, opts = loss_fn(module), optimizers(chains)

    @jax.jit
    def train(params, x, y):
        params = random_rescale(skeleton_init(params, chains), chains, jax.random.PRNGKey(3),
                                0.5)
        out = {"init": params}
        for name in names:
            opt = opts[name]

            def step(carry, _):
                p, s = carry
                u, s = opt.update(jax.grad(loss)(p, x, y), s, p)
                return (optax.apply_updates(p, u), s), None

            out[name] = jax.lax.scan(step, (params, opt.init(params)), length=STEPS)[0][0]
        return out
    return train, opts


def relative(a, b) -> float:
    """The largest ``|a - b|`` of a leaf over the largest ``|b|`` of that leaf."""
    a, b = jax.device_get((a, b))     # NumPy: an eager JAX operation compiles per sharding
    return max(float(np.max(np.abs(x - y)) / np.max(np.abs(y)))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def most_bytes(tree) -> int:
    """The most bytes ``tree``'s arrays hold on any one device."""
    held = {}
    for a in jax.tree_util.tree_leaves(tree):
        for shard in a.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values())


def misplaced(got, expected) -> list[str]:
    """The key paths of ``got``'s arrays not placed as ``expected``'s (a step count:
    committed to fewer than all the devices)."""
    def placed_as(a, b) -> bool:
        if a.ndim == 0:
            return not a.committed or len(a.sharding.device_set) == jax.device_count()
        return a.sharding.is_equivalent_to(b.sharding, a.ndim)

    return [jax.tree_util.keystr(path) for (path, a), b in
            zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(expected))
            if not placed_as(a, b)]


def layouts(m) -> dict:
    errors, built = {}, {}
    for name, (kind, spec, batch) in LAYOUTS.items():
        if kind not in built:
            module, params, chains, x, y = model(kind)
            built[kind] = (module, params, chains, x, y,
                           trainer(module, chains, TRANSFORMS)[0](params, x, y))
        module, params, chains, x, y, reference = built[kind]
        got = trainer(module, chains, TRANSFORMS)[0](
            place(params, spec, m), jax.device_put(x, NamedSharding(m, batch)),
            jax.device_put(y, NamedSharding(m, P(batch[0]))))
        errors[name] = {k: relative(got[k], reference[k]) for k in got}
    return errors


def init_each(opts: dict, params) -> dict:
    return {k: o.init(params) for k, o in opts.items()}


def placements(m) -> tuple[dict, dict]:
    """``misplaced`` and ``state_bytes`` of each layout: every transformation's ``init``
    under one ``jit`` without ``out_shardings`` (XLA places what the inits tie to the
    params; one compilation per layout), against the eager ``init`` (G-Adam's: Adam's own
    of the params, which places each buffer like its leaf; the eager G-Adam ``init``, whose
    every path value is an eager computation compiled anew per sharding, on FSDP alone)."""
    wrong, state_bytes = {}, {}
    for name, (kind, spec, _) in LAYOUTS.items():
        _, params, chains, _, _ = model(kind)
        placed, opts = place(params, spec, m), optimizers(chains)
        states = jax.jit(functools.partial(init_each, opts))(placed)
        eager = {k: o.init(placed) for k, o in opts.items() if k != "in_path_space"}
        eager["in_path_space"] = InPathSpaceState(ADAM.init(placed))
        wrong[name] = {k: misplaced(states[k], eager[k]) for k in opts}
        if name == "fsdp":
            wrong["eager G-Adam"] = misplaced(opts["in_path_space"].init(placed),
                                              eager["in_path_space"])
        state_bytes[name] = {"params": most_bytes(placed)}
        state_bytes[name] |= {k: most_bytes(s) for k, s in states.items()}
    return wrong, state_bytes


def weight_sized_moves(m) -> dict:
    """How many arrays larger than a layer's width (a weight, or a shard of one) the
    collectives of an update move, compiled alone with gradients placed like the params
    (the gradient computation's own collectives are not in it)."""
    counts = {}
    for name, transform in COLLECTIVES:
        kind, spec, _ = LAYOUTS[name]
        _, params, chains, _, _ = model(kind)
        placed, opt = place(params, spec, m), optimizers(chains)[transform]
        hlo = jax.jit(opt.update).lower(placed, opt.init(placed), placed).compile().as_text()
        found = collectives(hlo)
        counts[f"{name}/{transform}"] = {
            "arrays": len(found), "weight_sized": weight_sized(found, max(chains[0].chain.sizes))}
    return counts


def refusals(m):
    """The error of each placement the step cannot follow (eager ``opt.init``/``update``)."""
    module, params, chains, x, _ = model("mlp")
    opt = gsgd(0.05, chains, momentum=0.9)
    placed = place(params, lambda path, a: P(), m)
    devices = jax.devices()
    cases = {
        # one kernel on two of the mesh's devices
        "two_devices": lambda t: jax.device_put(t, NamedSharding(
            jax.sharding.Mesh(np.array(devices[:2]), ("x",)), P("x"))),
        # one kernel on the mesh's devices in another order: another mesh
        "other_mesh": lambda t: jax.device_put(t, NamedSharding(
            jax.sharding.Mesh(np.array(devices)[[1, 0, 3, 2]], ("x",)), P("x"))),
        "one_device": lambda t: jax.device_put(t, devices[3]),
    }
    refused = {"fsdp_eager": _error(lambda: _validated(chains, place(params, LAYOUTS["fsdp"][1],
                                                                     m)))}
    for case, move in cases.items():
        bad = jax.tree_util.tree_map(lambda a: a, placed)
        bad["Dense_1"]["kernel"] = move(bad["Dense_1"]["kernel"])
        refused[case] = _error(lambda: opt.init(bad))
    # a leaf outside the chains that JAX may move (uncommitted: made on the default device)
    refused["uncommitted"] = _error(lambda: opt.init(placed | {"scale": jax.numpy.ones(16)}))
    # gradients on other devices than the params
    grads = jax.tree_util.tree_map(lambda a: jax.device_put(a, devices[0]), placed)
    refused["grads_elsewhere"] = _error(lambda: opt.update(grads, opt.init(placed), placed))
    explicit = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    sharded = place(params, lambda path, a: P(None, "model") if a.ndim == 2 else P(), explicit)
    refused["explicit_axes"] = _error(lambda: jax.jit(opt.init)(sharded))
    return refused


def _validated(chains, params):
    """The core's validation of an eager update's arrays (kernels sharded, biases replicated:
    one mesh, two shardings), without the update's arithmetic, each eager operation of which
    compiles anew for every sharding."""
    index = {p: i for i, p in enumerate(key_paths(params)[0])}
    W, b = chains[0].arrays(index, key_paths(params)[1])
    prepare(chains[0].chain, W, b, grads=W, bias_grads=b)


def _error(fn):
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def main():
    m = mesh()
    wrong, state_bytes = placements(m)
    json.dump({"errors": layouts(m), "misplaced": wrong, "state_bytes": state_bytes,
               "refused": refusals(m),
               "collectives": weight_sized_moves(m)}, sys.stdout)


if __name__ == "__main__":
    main()
