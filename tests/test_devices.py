"""Every public function of the core keeps the weights' device and dtype: torch ``meta``
tensors in, ``meta`` tensors of the same dtype out.

On a CPU the default device is the weights' own, so an array made without ``device=``
(or with ``device=None``) goes unnoticed there and shows only on a GPU. A ``meta`` tensor
stands for a GPU's: torch refuses to mix it with a CPU tensor other than a 0-d one, and
every array that comes back must be on ``meta``. Meta tensors hold no values, so nothing
here checks a number: the other tests do that on every namespace.
"""

from __future__ import annotations

import numpy as np
import pytest

import gsgd_core as gc
from gsgd_core.arrays import prepare

torch = pytest.importorskip("torch")

#: weight shapes in the layers' own layouts, bias flags, skeleton scale (see ``Chain``).
CHAINS = {
    "mlp": ([(4, 3), (1, 4), (5, 1), (2, 5)], True, None),
    "mlp-units": ([(4, 3), (5, 4), (2, 5)], [True, False, True], [2.0, 0.5, 4.0]),
    "conv-flatten": ([(4, 2, 3), (6, 4, 1, 2), (3, 24)], [False, True, True], [1.0, 3.0, 1.0]),
}


def _problem(shapes, bias, scale, dtype):
    """The chain, and its weights, biases and their gradients as ``meta`` tensors."""
    chain = gc.Chain.from_shapes(shapes, bias=bias, skeleton_scale=scale)

    def arrays():
        W = [torch.empty(s, dtype=dtype, device="meta") for s in shapes]
        b = [torch.empty(n, dtype=dtype, device="meta") if f else None
             for n, f in zip(chain.sizes[1:], chain.bias)]
        return W, b
    return (chain, *arrays(), *arrays())


def _leaves(tree):
    """Every array of a result: through tuples, lists and named tuples, ``None`` left out."""
    if tree is None:
        return []
    if isinstance(tree, (tuple, list)):
        return [a for t in tree for a in _leaves(t)]
    return [tree]


def _momentum_steps(chain, W, b, G, Gb):
    state = gc.gsgd_init(chain, W, b)
    results, states = [], [state]
    for _ in range(2):  # the second step reads the buffers the first one set
        W2, b2, state = gc.gsgd_update(chain, state, W, b, G, Gb, lr=0.1, momentum=0.9,
                                       nesterov=True, weight_decay=1e-3)
        results += [W2, b2]
        states.append(state)
    return results, states


def _rule_steps(rule):
    def steps(chain, W, b, G, Gb):
        state = gc.path_init(chain, rule, W, b)
        results, states = [], [state]
        for _ in range(2):
            W2, b2, state = gc.path_update(chain, rule, state, W, b, G, Gb)
            results += [W2, b2]
            states.append(state)
        return results, states
    return steps


def _psi_steps(chain, W, b, G, Gb):
    state = gc.psi_init(W)
    results, states = [], [state]
    for _ in range(2):
        W2, state = gc.psi_update(state, W, G, lr=0.1, momentum=0.9)
        results.append(W2)
        states.append(state)
    return results, states


def _stateless(f):
    return lambda *args: (f(*args), [])


#: Each call returns the arrays it computes and the states it keeps.
CALLS = {
    "path_values": _stateless(lambda c, W, b, G, Gb: gc.path_values(c, W, b)),
    "icr": _stateless(lambda c, W, b, G, Gb: gc.icr(c, W, b, G, Gb)),
    "gsgd_step": _stateless(lambda c, W, b, G, Gb: gc.gsgd_step(c, W, b, G, Gb, 0.1)),
    "gsgd_update": _momentum_steps,
    "rescale-host-scales": _stateless(lambda c, W, b, G, Gb: gc.rescale(
        c, W, b, gc.random_rescaling(c, np.random.default_rng(0)))),
    "rescale-meta-scales": _stateless(lambda c, W, b, G, Gb: gc.rescale(
        c, W, b, [torch.ones(n, device="meta") for n in c.sizes[1:-1]])),
    "canonicalize": _stateless(lambda c, W, b, G, Gb: gc.canonicalize(c, W, b)),
    "skeleton_init": _stateless(lambda c, W, b, G, Gb: gc.skeleton_init(c, W, b)),
    "skeleton_init-signs-rest": _stateless(lambda c, W, b, G, Gb: gc.skeleton_init(
        c, W, b, keep_signs=True, rest_scale=0.5)),
    "weights_from_path_values": _stateless(
        lambda c, W, b, G, Gb: gc.weights_from_path_values(c, G, Gb, W)),
    "allocate": _stateless(lambda c, W, b, G, Gb: gc.allocate(c, W, b, G, Gb)),
    "path_sgd_gamma": _stateless(lambda c, W, b, G, Gb: gc.path_sgd_gamma(c, W, b)),
    "path_sgd_step": _stateless(lambda c, W, b, G, Gb: gc.path_sgd_step(c, W, b, G, Gb, 0.1)),
    "sgd_rule": _rule_steps(gc.sgd_rule(0.1, momentum=0.9, weight_decay=1e-3)),
    "adam_rule": _rule_steps(gc.adam_rule(0.01, weight_decay=0.1, amsgrad=True)),
    "adamw_rule": _rule_steps(gc.adamw_rule(0.01)),
    "psi_update": _psi_steps,
}
#: The states of rules in path space hold path values, kept in the compute dtype
#: (``path_init``): float32 for float16 weights.
IN_THE_COMPUTE_DTYPE = {"sgd_rule", "adam_rule", "adamw_rule"}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("layout", CHAINS.values(), ids=CHAINS.keys())
@pytest.mark.parametrize("name", CALLS)
def test_every_result_is_on_the_weights_device_in_their_dtype(name, layout, dtype):
    """Every array a core function returns (new weights, biases, path values, states) is a
    ``meta`` tensor when the weights are. Results are of the weights' dtype (float16 is
    computed in float32 and written back); so are the buffers of G-SGD's and PSI-SGD's
    states, while a path-space rule keeps its buffers in the compute dtype. The steps a
    state counts are a 0-d integer."""
    chain, W, b, G, Gb = _problem(*layout, dtype)
    results, states = map(_leaves, CALLS[name](chain, W, b, G, Gb))
    assert results and all(isinstance(a, torch.Tensor) for a in results + states)
    assert {a.device.type for a in results + states} == {"meta"}
    assert {a.dtype for a in results} == {dtype}
    if states:
        compute = torch.float32 if dtype == torch.float16 else dtype
        buffers = {a.dtype for a in states if a.is_floating_point()}
        assert buffers == {compute if name in IN_THE_COMPUTE_DTYPE else dtype}
    counts = [a for a in states if not a.is_floating_point()]
    assert all(a.ndim == 0 and a.dtype == torch.int32 for a in counts)


@pytest.mark.parametrize("name", [n for n in CALLS if n != "rescale-meta-scales"])
def test_every_result_stays_on_a_device_that_takes_no_array_from_another(name):
    """array_api_strict's second device refuses to combine any array made elsewhere, even
    a 0-d one (which torch lets a ``meta`` tensor take): with every input there, every
    result and state comes back there."""
    xs = pytest.importorskip("array_api_strict")
    other, rng = xs.Device("device1"), np.random.default_rng(0)
    chain, W, b, G, Gb = _problem(*CHAINS["mlp-units"], torch.float32)
    W, b, G, Gb = ([None if a is None else xs.asarray(
        rng.standard_normal(tuple(a.shape)).astype(np.float32), device=other) for a in arrays]
        for arrays in (W, b, G, Gb))
    results, states = map(_leaves, CALLS[name](chain, W, b, G, Gb))
    assert results and {a.device for a in results + states} == {other}


def test_layer_metadata_is_cached_per_namespace_and_device():
    """A chain builds its index arrays once per namespace and device and hands the same
    ones out again; used on the CPU and then on ``meta``, it gets arrays of each device
    (one cache entry cannot serve both)."""
    chain = gc.Chain.mlp([3, 4, 2])
    cpu = [torch.ones(4, 3), torch.ones(2, 4)], [torch.ones(4), torch.ones(2)]
    meta = [[a.to("meta") for a in arrays] for arrays in cpu]
    first = prepare(chain, *cpu).meta
    assert prepare(chain, *cpu).meta is first
    assert {m.tau_idx.device.type for m in first} == {"cpu"}
    assert {m.free_mask.device.type for m in prepare(chain, *meta).meta} == {"meta"}
    assert {a.device.type for a in gc.path_values(chain, *meta)[0]} == {"meta"}
    assert prepare(chain, *cpu).meta is first


def test_hyperparameters_given_as_arrays_on_another_device_join_the_weights_device():
    """A 0-d learning rate, momentum and weight decay made on array_api_strict's default
    device (a schedule's values) step weights on its second device: they are moved to the
    weights', and the step is the one of the same Python numbers."""
    xs = pytest.importorskip("array_api_strict")
    other, rng = xs.Device("device1"), np.random.default_rng(0)
    chain, W, b, G, Gb = _problem(*CHAINS["mlp-units"], torch.float64)
    W, b, G, Gb = ([None if a is None else xs.asarray(rng.standard_normal(tuple(a.shape)),
                                                        device=other) for a in arrays]
                   for arrays in (W, b, G, Gb))
    state = gc.gsgd_init(chain, W, b)
    hypers = dict(lr=0.1, momentum=0.9, weight_decay=1e-3)
    got = gc.gsgd_update(chain, state, W, b, G, Gb, **{k: xs.asarray(v) for k, v in
                                                       hypers.items()})
    want = gc.gsgd_update(chain, state, W, b, G, Gb, **hypers)
    assert {a.device for a in _leaves(got)} == {other}
    cpu = xs.Device("CPU_DEVICE")
    for x, y in zip(_leaves(got), _leaves(want), strict=True):
        assert np.allclose(np.asarray(x.to_device(cpu)), np.asarray(y.to_device(cpu)),
                           rtol=1e-14, atol=0)


def test_a_chain_used_under_jit_on_committed_weights_is_used_eagerly_after():
    """Under ``jax.jit``, the layer metadata of weights committed to a device (closed over,
    so concrete) are tracers: none is kept on the chain, and an eager call after the traced
    one gets arrays of its own."""
    jax = pytest.importorskip("jax")
    chain = gc.Chain.mlp([3, 4, 2])
    device = jax.devices()[0]
    W, b = ([jax.device_put(jax.numpy.ones(s), device) for s in shapes]
            for shapes in ([(4, 3), (2, 4)], [(4,), (2,)]))
    traced = jax.jit(lambda: gc.path_values(chain, W, b))()
    eager = gc.path_values(chain, W, b)
    for x, y in zip(traced[0] + traced[1], eager[0] + eager[1]):
        assert np.array_equal(np.asarray(x), np.asarray(y))
