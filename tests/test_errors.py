"""Bad input gets a ValueError that names the layer and the shapes, before any arithmetic."""

import numpy as np
import pytest
import torch

import gsgd_core as gc

CHAIN = gc.Chain((3, 4, 2), (1, 3), bias=(True, False))


class Untouchable(np.ndarray):
    """An array that fails loudly if any arithmetic reaches it."""

    def __array_ufunc__(self, *args, **kwargs):
        raise AssertionError("arithmetic ran before validation")

    def __array_function__(self, *args, **kwargs):
        raise AssertionError("arithmetic ran before validation")


def _params(kind=np.asarray):
    W = [kind(np.ones((4, 3))), kind(np.ones((2, 4, 3)))]
    return W, [kind(np.ones(4)), None], [kind(np.ones((4, 3))), kind(np.ones((2, 4, 3)))], [
        kind(np.ones(4)), None]


def _untouchable(a):
    return np.asarray(a).view(Untouchable)


@pytest.mark.parametrize("mutate, message", [
    (lambda W, b, G, Gb: (W[:1], b, G, Gb), "weights has 1 entries, but the chain has 2 layers"),
    (lambda W, b, G, Gb: ([W[0], np.ones((2, 5, 3))], b, G, Gb),
     r"layer 2: weight has shape \(2, 5, 3\), but the chain expects \(2, 12\)"),
    (lambda W, b, G, Gb: (W, b, [G[0], np.ones((2, 12))], Gb),
     r"layer 2: grads\[1\] has shape \(2, 12\), but the weight has shape \(2, 4, 3\)"),
    (lambda W, b, G, Gb: (W, [None, None], G, Gb), r"layer 1: the chain has a bias here"),
    (lambda W, b, G, Gb: (W, [b[0], np.ones(2)], G, Gb), r"layer 2: the chain has no bias"),
    (lambda W, b, G, Gb: (W, [np.ones(3), None], G, Gb), r"layer 1: bias has shape \(3,\)"),
    (lambda W, b, G, Gb: (W, b, G, [None, None]),
     r"^layer 1: the layer has a bias but bias_grads\[0\] is None$"),
    (lambda W, b, G, Gb: (W, b, [G[0], "g"], Gb), r"^layer 2: grads\[1\] is a str, not an array$"),
    (lambda W, b, G, Gb: (W, b, G, None), r"layer 1: the layer has a bias but"),
    (lambda W, b, G, Gb: (W, b, G, [np.ones(4), np.ones(2)]),
     r"layer 2: bias_grads\[1\] given for a layer without a bias"),
    (lambda W, b, G, Gb: ([W[0], np.ones((3, 12))], b, G, Gb),
     r"layer 2: weight has shape \(3, 12\)"),
    (lambda W, b, G, Gb: ([np.ones(4), W[1]], b, G, Gb), r"layer 1: weight has shape \(4,\)"),
    (lambda W, b, G, Gb: ([W[0], np.ones((2, 4, 2))], b, G, Gb),
     r"layer 2: weight has shape \(2, 4, 2\)"),
    (lambda W, b, G, Gb: ([W[0], np.ones((2, 12, 1))], b, G, Gb),
     r"layer 2: weight has shape \(2, 12, 1\)"),
    (lambda W, b, G, Gb: (W, b, G, [np.ones(5), None]),
     r"layer 1: bias_grads\[0\] has shape \(5,\), but the bias has shape \(4,\)"),
    (lambda W, b, G, Gb: ([W[0], "w"], b, G, Gb), "layer 2: weight is a str, not an array"),
    (lambda W, b, G, Gb: ([np.ones((4, 3), dtype=int), W[1]], b, G, Gb), "real floating"),
    (lambda W, b, G, Gb: (W, b, [G[0].astype(np.float32), G[1]], Gb), "share the weights' dtype"),
    (lambda W, b, G, Gb: (W, b, [torch.ones(4, 3, dtype=torch.float64), G[1]], Gb),
     "one array namespace"),
    # a string is a sequence, and one of the layer count's length is refused as a string
    (lambda W, b, G, Gb: ("ab", b, G, Gb),
     r"^weights must be a list with one entry per layer \(2\), got str$"),
    (lambda W, b, G, Gb: (W, b, G, b"ab"),
     r"^bias_grads must be a list with one entry per layer \(2\), got bytes$"),
    (lambda W, b, G, Gb: (None, b, G, Gb),
     r"^weights must be a list with one entry per layer \(2\), got NoneType$"),
    (lambda W, b, G, Gb: (W, [None, None], G, Gb),
     r"^layer 1: the chain has a bias here but biases\[0\] is None$"),
    (lambda W, b, G, Gb: ([np.asarray(1.0), W[1]], b, G, Gb),
     r"^layer 1: weight has shape \(\), but the chain expects \(4, 3\)"),
    (lambda W, b, G, Gb: ([W[0], np.ones((2, 13))], b, G, Gb),
     r"^layer 2: weight has shape \(2, 13\), but the chain expects \(2, 12\)"),
    # the biases share the weights' namespace and dtype like every other array
    (lambda W, b, G, Gb: (W, [b[0].astype(np.float32), None], G, Gb),
     r"^all arrays must share the weights' dtype float64; found an array of dtype float32 "
     r"and shape \(4,\)$"),
    (lambda W, b, G, Gb: (W, [torch.ones(4, dtype=torch.float64), None], G, Gb),
     "^all arrays must come from one array namespace"),
    # a step without its gradients
    (lambda W, b, G, Gb: (W, b, None, Gb),
     r"^grads must be a list with one entry per layer \(2\), got NoneType$"),
])
def test_structural_errors_name_layer_and_shapes(mutate, message):
    W, b, G, Gb = mutate(*_params())
    with pytest.raises(ValueError, match=message):
        gc.gsgd_step(CHAIN, W, b, G, Gb, 0.1)


def test_errors_come_before_any_arithmetic():
    W, b, G, Gb = _params(_untouchable)
    with pytest.raises(ValueError, match="layer 2: grads"):
        gc.gsgd_step(CHAIN, W, b, [G[0], _untouchable(np.ones((2, 12)))], Gb, 0.1)
    with pytest.raises(ValueError, match="lr must be finite and >= 0"):
        gc.gsgd_step(CHAIN, W, b, G, Gb, -0.1)


@pytest.mark.parametrize("hyper, message", [
    (dict(lr=-1.0), "lr must be finite and >= 0, got -1.0"),
    (dict(lr=float("nan")), "lr must be finite"),
    (dict(lr=float("inf")), "lr must be finite"),
    (dict(lr=0.1, momentum=-0.5), "momentum must be finite and >= 0"),
    (dict(lr=0.1, momentum=0.9, dampening=1.5), r"dampening must be finite and in \[0, 1\]"),
    (dict(lr=0.1, weight_decay=-1e-4), "weight_decay must be finite and >= 0"),
    (dict(lr=0.1, nesterov=True), "nesterov needs momentum > 0 and dampening = 0"),
    (dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "nesterov needs"),
    (dict(lr=True), "lr must be a number"),
    (dict(lr=np.ones(2)), "lr must be a Python number or a 0-d array"),
    # NumPy's float32 is a numbers.Real but not a float: checked as a number all the same
    (dict(lr=np.float32(-1.0)), r"lr must be finite and >= 0, got np.float32\(-1.0\)"),
    (dict(lr=0.1, momentum=np.float32("nan")), "momentum must be finite"),
    (dict(lr="fast"), r"^lr must be a Python number or a 0-d array, got 'fast'$"),
])
def test_hyperparameter_errors(hyper, message):
    W, b, G, Gb = _params()
    state = gc.gsgd_init(CHAIN, W, b)
    with pytest.raises(ValueError, match=message):
        gc.gsgd_update(CHAIN, state, W, b, G, Gb, **hyper)


def test_hyperparameters_at_their_bounds_are_accepted():
    """Bounds are inclusive: dampening = 1 and momentum = 0 are valid; a 0-d array is a
    valid learning rate (a traced schedule) and gives the float's result."""
    W, b, G, Gb = _params()
    state = gc.gsgd_init(CHAIN, W, b)
    gc.gsgd_update(CHAIN, state, W, b, G, Gb, lr=0.1, momentum=0.9, dampening=1.0)
    gc.gsgd_update(CHAIN, state, W, b, G, Gb, lr=0.0, momentum=0.0, weight_decay=0.0)
    W1, b1 = gc.gsgd_step(CHAIN, W, b, G, Gb, np.asarray(0.1))
    W2, b2 = gc.gsgd_step(CHAIN, W, b, G, Gb, 0.1)
    assert all(np.array_equal(x, y) for x, y in zip(W1 + b1[:1], W2 + b2[:1]))


def test_a_zero_hyperparameter_given_as_an_array_keeps_its_state():
    """A momentum of 0 given as a 0-d array (a schedule's value, which may rise later) keeps
    the momentum buffers: the step is plain SGD's, and the buffers hold its path-space
    direction. A Python 0 switches momentum off and leaves them as they were."""
    W, b, G, Gb = _params()
    state = gc.gsgd_init(CHAIN, W, b)
    W0, b0, off = gc.gsgd_update(CHAIN, state, W, b, G, Gb, lr=0.1, momentum=0.0)
    W1, b1, on = gc.gsgd_update(CHAIN, state, W, b, G, Gb, lr=0.1, momentum=np.asarray(0.0))
    assert all(np.allclose(x, y, rtol=1e-14, atol=0) for x, y in zip(W0 + b0[:1], W1 + b1[:1]))
    assert all(not np.any(m) for m in off.momentum + off.bias_momentum[:1])
    assert all(np.any(m) for m in on.momentum + on.bias_momentum[:1])


def test_errors_at_the_first_layer_name_its_index_and_no_biases_still_checks_every_layer():
    """A refusal gives the list index of the layer it names, 0 for layer 1; and with
    ``biases=None`` every layer's weight and gradient is still checked."""
    chain = gc.Chain((3, 4, 2), (1, 3), bias=(False, True))
    W, G = [np.ones((4, 3)), np.ones((2, 4, 3))], [np.ones((4, 3)), np.ones((2, 4, 3))]
    b, Gb = [None, np.ones(2)], [None, np.ones(2)]
    for biases, grads, bias_grads, message in [
            ([np.ones(4), b[1]], G, Gb, "layer 1: the chain has no bias here but biases[0] is "
                                        "an array of shape (4,)"),
            (b, G, [np.ones(4), Gb[1]], "layer 1: bias_grads[0] given for a layer without a "
                                        "bias"),
            (b, ["g", G[1]], Gb, "layer 1: grads[0] is a str, not an array")]:
        with pytest.raises(ValueError) as err:
            gc.gsgd_step(chain, W, biases, grads, bias_grads, 0.1)
        assert str(err.value) == message
    plain = gc.Chain((3, 4, 2), (1, 3), bias=False)
    for weights, grads, message in [
            ([W[0], np.ones((2, 5, 3))], G, r"^layer 2: weight has shape \(2, 5, 3\)"),
            (W, [G[0], np.ones((2, 5))], r"^layer 2: grads\[1\] has shape \(2, 5\)")]:
        with pytest.raises(ValueError, match=message):
            gc.gsgd_step(plain, weights, None, grads, None, 0.1)


def test_momentum_needs_a_state_and_a_matching_one():
    W, b, G, Gb = _params()
    with pytest.raises(ValueError, match=r"^momentum needs a state: create one with "
                                         r"gsgd_init\(chain, weights, biases\)$"):
        gc.gsgd_update(CHAIN, None, W, b, G, Gb, lr=0.1, momentum=0.9)
    other = gc.gsgd_init(gc.Chain((3, 4, 2), (1, 1), bias=(True, False)),
                         [np.ones((4, 3)), np.ones((2, 4))], [np.ones(4), None])
    with pytest.raises(ValueError, match=r"layer 2: momentum\[1\] has shape \(2, 4\)"):
        gc.gsgd_update(CHAIN, other, W, b, G, Gb, lr=0.1, momentum=0.9)


@pytest.mark.parametrize("field, message", [
    ("momentum", r"^layer 1: state.momentum\[0\] is None; a step with momentum needs a "
                 r"buffer per layer \(gsgd_init makes them\)$"),
    ("bias_momentum", r"^layer 1: the layer has a bias but state.bias_momentum\[0\] is "
                      r"None \(gsgd_init makes every buffer\)$")])
def test_a_momentum_step_names_the_buffer_its_state_lacks(field, message):
    state = gc.gsgd_init(CHAIN, *_params()[:2])
    state = state._replace(**{field: (None,) + tuple(getattr(state, field)[1:])})
    W, b, G, Gb = _params(_untouchable)
    with pytest.raises(ValueError, match=message):
        gc.gsgd_update(CHAIN, state, W, b, G, Gb, lr=0.1, momentum=0.9)
    # without momentum no buffer is read; a layer without a bias has none (gsgd_init's None)
    W, b, G, Gb = _params()
    gc.gsgd_update(CHAIN, state, W, b, G, Gb, lr=0.1)
    fresh = gc.gsgd_init(CHAIN, W, b)
    assert fresh.bias_momentum[1] is None
    gc.gsgd_update(CHAIN, fresh, W, b, G, Gb, lr=0.1, momentum=0.9)


def test_zero_learning_rate_is_the_identity():
    W, b, G, Gb = _params()
    W2, b2 = gc.gsgd_step(CHAIN, W, b, G, Gb, 0.0)
    assert all(np.array_equal(x, y) for x, y in zip(W + b[:1], W2 + b2[:1]))


@pytest.mark.parametrize("scales, message", [
    ([np.ones(4), np.ones(2)], "scales has 2 vectors, but the chain has 1 hidden layers"),
    ([np.ones(3)], "hidden layer 1: scales have shape (3,), expected (4,)"),
    ([np.array([1.0, 0.0, 1.0, 1.0])], "hidden layer 1: scales must be finite and > 0"),
    ([[1.0, 2.0, np.inf, 1.0]], "hidden layer 1: scales must be finite and > 0"),
    ("abc", "scales must be a list of 1 vectors (one per hidden layer), got str"),
    (np.ones((1, 4)), "scales must be a list of 1 vectors (one per hidden layer), got ndarray"),
])
def test_rescale_errors(scales, message):
    W, b, _, _ = _params()
    with pytest.raises(ValueError) as err:
        gc.rescale(CHAIN, W, b, scales)
    assert str(err.value) == message


def test_rescale_errors_count_a_deeper_chains_hidden_layers():
    """On a chain of two hidden layers, the refusals of a wrong count or a string of
    scales say two, the number of hidden layers (not of layers, nor one)."""
    chain = gc.Chain((3, 4, 4, 2))
    W = [np.ones(chain.layer_shape(l)) for l in range(1, chain.L + 1)]
    for scales, message in [
            ([np.ones(4)], "scales has 1 vectors, but the chain has 2 hidden layers"),
            ("ab", "scales must be a list of 2 vectors (one per hidden layer), got str")]:
        with pytest.raises(ValueError) as err:
            gc.rescale(chain, W, None, scales)
        assert str(err.value) == message


def test_skeleton_init_validates_the_biases_it_is_given():
    """Biases may be left out, but biases given are checked like every entry point's."""
    W, b, _, _ = _params()
    for biases, message in [
            ([np.ones(3), None], "layer 1: bias has shape (3,), expected (4,)"),
            ([np.ones(4)], "biases has 1 entries, but the chain has 2 layers"),
            ([np.ones(4), np.ones(2)],
             "layer 2: the chain has no bias here but biases[1] is an array of shape (2,)")]:
        with pytest.raises(ValueError) as err:
            gc.skeleton_init(CHAIN, W, biases)
        assert str(err.value) == message


def test_other_entry_points_validate_too():
    W, b, G, Gb = _params()
    with pytest.raises(ValueError, match="^chain must be a gsgd_core.Chain, got tuple$"):
        gc.path_values((3, 4, 2), W, b)
    with pytest.raises(ValueError, match="rng must be a numpy.random.Generator, got int$"):
        gc.random_rescaling(CHAIN, 0)
    for spread in (-1.0, np.nan, np.inf):
        with pytest.raises(ValueError, match="spread must be finite and >= 0"):
            gc.random_rescaling(CHAIN, np.random.default_rng(), spread)
    with pytest.raises(ValueError, match="lr must be finite and >= 0"):
        gc.path_sgd_step(CHAIN, W, b, G, Gb, -1.0)
    with pytest.raises(ValueError, match=r"layer 2: path values\[1\] has shape"):
        gc.weights_from_path_values(CHAIN, [W[0], np.ones((2, 4))], b, W)
    # a missing entry of one list does not end the checks of the entries after it
    with pytest.raises(ValueError, match=r"layer 2: path values\[1\] has shape \(2, 5\)"):
        gc.weights_from_path_values(CHAIN, [None, np.ones((2, 5))], b, W)
    with pytest.raises(ValueError, match=r"weight 0: grads has shape \(3,\)"):
        gc.psi_update(gc.psi_init(W), W, [np.ones(3), G[1]], lr=0.1)
    with pytest.raises(ValueError, match="lr must be finite and >= 0"):
        gc.psi_update(gc.psi_init(W), W, G, lr=-0.1)
    with pytest.raises(ValueError, match="^state must come from psi_init$"):
        gc.psi_update(None, W, G, lr=0.1)


@pytest.mark.parametrize("weights", [[], (), "ab", b"ab", np.ones((2, 3)), None, 3],
                         ids=["list", "tuple", "str", "bytes", "array", "None", "int"])
def test_psi_refuses_weights_that_are_not_a_non_empty_list(weights):
    with pytest.raises(ValueError, match="^weights must be a non-empty list of arrays$"):
        gc.psi_init(weights)
    with pytest.raises(ValueError, match="^weights must be a non-empty list of arrays$"):
        gc.psi_update(gc.PSIState(()), weights, [], lr=0.1)


def test_psi_names_the_list_whose_length_differs_from_the_weights():
    W = [np.ones((2, 3)), np.ones((4, 2))]
    state = gc.psi_init(W)
    with pytest.raises(ValueError, match=r"^grads has 1 entries for 2 weights$"):
        gc.psi_update(state, W, W[:1], lr=0.1)
    with pytest.raises(ValueError, match=r"^momentum buffers has 3 entries for 2 weights$"):
        gc.psi_update(gc.PSIState((*state.momentum, W[0])), W, W, lr=0.1)
    with pytest.raises(ValueError, match=r"^weight 1: grads has shape \(2, 4\), but the weight "
                                         r"has shape \(4, 2\)$"):
        gc.psi_update(state, W, [W[0], np.ones((2, 4))], lr=0.1)
    with pytest.raises(ValueError, match=r"^weight 0: weights and momentum buffers must be "
                                         r"arrays$"):
        gc.psi_update(gc.PSIState(([1.0], W[1])), W, W, lr=0.1)


def test_the_shared_hyperparameter_check_defaults_to_everything_off():
    """``check_update_hypers``, which the in-place layer and the adapters call with only
    some arguments, defaults to no momentum, no dampening and no Nesterov."""
    from gsgd_core.gsgd import check_update_hypers

    check_update_hypers(0.1)
    check_update_hypers(0.1, momentum=0.9, nesterov=True)
    with pytest.raises(ValueError, match=r"^nesterov needs momentum > 0 and dampening = 0, "
                                         r"got momentum=0.0, dampening=0.0$"):
        check_update_hypers(0.1, nesterov=True)


@pytest.mark.parametrize("step", [
    lambda chain, W, b, G, Gb: gc.icr(chain, W, b, G, Gb),
    lambda chain, W, b, G, Gb: gc.path_sgd_step(chain, W, b, G, Gb, 0.1)],
    ids=["icr", "path_sgd_step"])
@pytest.mark.parametrize("change, message", [
    (lambda G, Gb: ([G[0], G[1][:, :2]], Gb),
     r"layer 2: grads\[1\] has shape \(2, 2, 3\), but the weight has shape \(2, 4, 3\)"),
    (lambda G, Gb: (G[:1], Gb), "grads has 1 entries, but the chain has 2 layers"),
    (lambda G, Gb: (G, [Gb[0][:1], None]),
     r"layer 1: bias_grads\[0\] has shape \(1,\), but the bias has shape \(4,\)")])
def test_gradients_of_the_wrong_shape_or_count_are_refused_by_name(step, change, message):
    W, b, G, Gb = _params()
    with pytest.raises(ValueError, match=f"^{message}$"):
        step(CHAIN, W, b, *change(G, Gb))


def test_psi_refuses_integer_weights_even_with_integer_gradients_of_their_dtype():
    """PSI-SGD moves weights by real steps: integer weights are refused with the dtypes
    named, also where the gradients share their dtype."""
    W = [np.ones((2, 3), dtype=np.int64)]
    with pytest.raises(ValueError, match="^weights and grads must share one real floating "
                                         "dtype, got int64 and int64$"):
        gc.psi_update(gc.psi_init(W), W, W, lr=0.1)
