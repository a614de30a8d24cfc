"""Sharded JAX params on a 2x2 mesh of 4 host devices, under ``jax.jit``: every layout
trains as one device does, the optimizer state is placed like the params, G-SGD's update
moves vectors between devices (never a weight), and placements the step cannot follow
are refused naming the leaf.

JAX takes its device count from XLA_FLAGS when it starts, so the work runs once in a
process of its own (``_jax_mesh_worker.py``); the tests read its results.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _jax_mesh import BUFFERS, COLLECTIVES, LAYOUTS, TRANSFORMS  # noqa: E402

from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

from gsgd_adapters.optax import chains_from_dict, gsgd, in_path_space  # noqa: E402

HERE = pathlib.Path(__file__).parent


@pytest.fixture(scope="module")
def mesh_run():
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    env = os.environ | {"XLA_FLAGS": flags, "PYTHONPATH": str(HERE.parent)}
    done = subprocess.run([sys.executable, str(HERE / "_jax_mesh_worker.py")], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_trains_as_one_device(mesh_run, layout):
    """skeleton_init, random_rescale and 3 steps of each transformation (momentum where it
    has one), float64 under jax.jit: the mesh's params equal one device's to 1e-12."""
    errors = mesh_run["errors"][layout]
    assert set(errors) == {"init", *TRANSFORMS}
    assert max(errors.values()) <= 1e-12, errors


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_init_under_jit_places_the_state_like_the_params(mesh_run, layout):
    """Under ``jax.jit`` without ``out_shardings``, each transformation's ``opt.init``
    places every buffer as an eager ``init`` does (like the leaf it belongs to) and its
    step counts over the whole mesh (or uncommitted, for the step to move)."""
    assert mesh_run["misplaced"][layout] == {k: [] for k in TRANSFORMS}


def test_eager_init_places_inner_buffers_like_the_params(mesh_run):
    """Outside ``jit`` too, G-Adam's Adam buffers are placed like the params' leaves, not
    like the path values Adam is given (which eager operations shard otherwise on FSDP)."""
    assert mesh_run["misplaced"]["eager G-Adam"] == []


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_optimizer_state_is_placed_like_the_params(mesh_run, layout):
    """A state made under ``jit`` holds on each device the buffers of the params' shards
    there (and step counts): sharded params get sharded state, not a copy on one device."""
    held = mesh_run["state_bytes"][layout]
    for name, buffers in BUFFERS.items():
        assert buffers * held["params"] <= held[name] <= buffers * held["params"] + 16, name


def test_sharded_layouts_hold_less_per_device(mesh_run):
    """The placement the state test compares with is real: sharded params hold less on a
    device than replicated ones."""
    held = mesh_run["state_bytes"]
    for layout in ("fsdp", "tensor", "mesh2d"):
        assert held[layout]["params"] < held["replicated"]["params"]


@pytest.mark.parametrize("layout, transform", COLLECTIVES)
def test_update_moves_no_weight_between_devices(mesh_run, layout, transform):
    """The compiled update's collectives move vectors of units (column sums, skeleton
    edges, path ratios), never a weight or a shard of one."""
    moved = mesh_run["collectives"][f"{layout}/{transform}"]
    assert moved["arrays"] > 0          # sharded chains do need their vectors reduced
    assert moved["weight_sized"] == 0, moved


def test_eager_arrays_on_one_mesh_in_two_shardings_are_accepted(mesh_run):
    """Kernels sharded and biases replicated on the same devices pass the core's
    validation outside ``jit`` too: it compares the devices arrays span, not their
    shardings."""
    assert mesh_run["refused"]["fsdp_eager"] is None


def test_a_leaf_jax_may_move_is_accepted_beside_placed_ones(mesh_run):
    """An uncommitted leaf (made on the default device, which JAX moves where it is used)
    outside the chains, beside leaves placed on the mesh, is not refused."""
    assert mesh_run["refused"]["uncommitted"] is None


@pytest.mark.parametrize("case, leaf, placements", [
    ("two_devices", "params leaf Dense_1/kernel", ("[0, 1]", "[0, 1, 2, 3]")),
    ("other_mesh", "params leaf Dense_1/kernel", ("[1, 0, 3, 2]", "[0, 1, 2, 3]")),
    ("one_device", "params leaf Dense_1/kernel", ("[3]", "[0, 1, 2, 3]",
                                                  "SingleDeviceSharding(device=CpuDevice(id=3)")),
    ("grads_elsewhere", "grads leaf Dense_0/bias", ("[0]", "[0, 1, 2, 3]")),
    ("explicit_axes", "params leaf Dense_0/kernel", ("('model',)", "Explicit")),
])
def test_placements_the_step_cannot_follow_are_refused(mesh_run, case, leaf, placements):
    """A ValueError names the leaf and both placements (devices, sharding) before any
    arithmetic."""
    message = mesh_run["refused"][case]
    assert message is not None and message.startswith(leaf), message
    for placement in placements:
        assert placement in message


def test_state_made_under_jit_is_zero_where_a_param_is_not_finite():
    """The buffers an ``init`` under ``jit`` ties to the params (to place them alike) hold
    the init's zeros, also where a param holds an Inf or a NaN (one device)."""
    params = {"l1": {"w": jnp.array([[1.0, jnp.inf], [jnp.nan, 2.0]]), "b": jnp.ones(2)},
              "l2": {"w": jnp.array([[-jnp.inf, 1.0]]), "b": jnp.ones(1)},
              "scale": jnp.array([jnp.nan, -jnp.inf])}     # outside the chain: SGD's buffer
    state = jax.jit(gsgd(0.1, chains_from_dict(params, ["l1", "l2"]), momentum=0.9).init)(params)
    buffers = jax.tree_util.tree_leaves(state)
    assert len(buffers) == 7        # weights', biases', the other leaf's, two step counts
    for buffer in buffers:
        assert np.array_equal(np.asarray(buffer), np.zeros(buffer.shape)), buffer


def _typed(a):
    """An array's numbers, a typed key's data included, with its dtype."""
    return a.dtype, np.asarray(jax.random.key_data(a) if jnp.issubdtype(
        a.dtype, jax.dtypes.prng_key) else a)


def test_state_made_under_jit_is_the_eager_one_beside_leaves_that_are_not_floats():
    """Params that also hold a typed PRNG key and integers (outside the chains) get the
    eager state under ``jit`` too: G-Adam's float32 moments of each leaf (those of the key
    cannot be tied to it by arithmetic)."""
    params = {"l1": {"w": jnp.arange(6.0).reshape(3, 2) - 2.5, "b": jnp.zeros(3)},
              "l2": {"w": jnp.ones((1, 3)), "b": jnp.zeros(1)},
              "key": jax.random.key(0), "index": jnp.arange(2)}
    chains = chains_from_dict(params, ["l1", "l2"])
    opt = in_path_space(optax.adam(0.1, mu_dtype=jnp.float32), chains)
    want, got = opt.init(params), jax.jit(opt.init)(params)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        (da, va), (db, vb) = _typed(a), _typed(b)
        assert da == db and np.array_equal(va, vb), (a, b)


def test_eager_state_of_params_jax_may_move_is_free_to_move_too():
    """Uncommitted params (which JAX moves where they are used) get an uncommitted eager
    state, as ``zeros_like`` makes it; a first leaf uncommitted beside others committed to
    the same device is accepted."""
    params = {"l1": {"w": jnp.arange(6.0).reshape(3, 2) - 2.5, "b": jnp.zeros(3)},
              "l2": {"w": jnp.ones((1, 3)), "b": jnp.zeros(1)}, "scale": jnp.ones(2)}
    chains = chains_from_dict(params, ["l1", "l2"])
    for opt in (gsgd(0.1, chains, momentum=0.9), in_path_space(optax.adam(0.1), chains)):
        state = opt.init(params)
        assert not any(a.committed for a in jax.tree_util.tree_leaves(state))
    placed = jax.tree_util.tree_map(lambda a: jax.device_put(a, jax.devices()[0]), params)
    placed["l1"]["b"] = jnp.zeros(3)       # l1/b is the first leaf in key order
    gsgd(0.1, chains, momentum=0.9).init(placed)


@pytest.mark.parametrize("inner", [optax.adagrad(0.1), optax.adafactor(0.01)])
def test_inner_state_made_under_jit_is_the_eager_one(inner):
    """An inner transformation's state made under ``jit`` (its buffers tied to the params
    to place them alike) is the eager one: Adagrad's accumulators start at 0.1, not zero,
    and Adafactor's per-leaf statistics keep their own shapes, not the params'."""
    params = {"l1": {"w": jnp.arange(6.0).reshape(3, 2) - 2.5, "b": jnp.zeros(3)},
              "l2": {"w": jnp.ones((1, 3)), "b": jnp.zeros(1)}}
    opt = in_path_space(inner, chains_from_dict(params, ["l1", "l2"]))
    want, got = opt.init(params), jax.jit(opt.init)(params)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert a.shape == b.shape and np.array_equal(a, b), (a, b)


@pytest.mark.parametrize("leaf, spec, axes", [
    (("l1", "w"), P(None, "model"), ("model",)),           # a chain leaf over an Explicit axis
    (("l1", "w"), P(("data", "model"), None), ("data", "model")),    # over two at once
    (("l1", "w"), P("auto", None), None),                  # over an Auto axis: followed
    (("scale",), P("model"), None),                        # outside the chains: SGD's leaf
])
def test_a_chain_leaf_sharded_over_explicit_axes_is_refused_on_one_device(leaf, spec, axes):
    """Sharding in types is refused for a chain leaf, naming it and the Explicit axes, on a
    mesh of one device too; a leaf sharded over Auto axes, or outside the chains, is not."""
    mesh = jax.make_mesh((1, 1, 1), ("data", "model", "auto"), axis_types=(
        AxisType.Explicit, AxisType.Explicit, AxisType.Auto))
    params = {"l1": {"w": jnp.ones((3, 2)), "b": jnp.zeros(3)},
              "l2": {"w": jnp.ones((1, 3)), "b": jnp.zeros(1)}, "scale": jnp.ones(2)}
    node = params if len(leaf) == 1 else params[leaf[0]]
    node[leaf[-1]] = jax.device_put(node[leaf[-1]], NamedSharding(mesh, spec))
    init = gsgd(0.1, chains_from_dict(params, ["l1", "l2"]), momentum=0.9).init
    # the placement printed: the array's sharding, or its type's where traced
    for run, where in ((init, str(node[leaf[-1]].sharding)), (jax.jit(init), f"spec={spec})")):
        if axes is None:
            run(params)
            continue
        with pytest.raises(ValueError, match=re.escape(
                f"params leaf {'/'.join(leaf)} is sharded over the Explicit mesh axes {axes} ("
                f"NamedSharding(mesh=")) as refused:
            run(params)
        assert where in str(refused.value), str(refused.value)
