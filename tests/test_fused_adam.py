"""The fused G-Adam step (gsgd_backends.fused_adam): G-Adam, G-AdamW and AMSGrad in the
fused step's three Triton launches against the core's path_update with AdamRule, compiled on
a CUDA device where there is one, else run by Triton's interpreter on CPU tensors.

As in test_fused (whose fixture, device and counting helpers these tests share), the
interpreter is set only while the fused modules are imported and while these tests run.
"""

import importlib

import numpy as np
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

import gsgd_core as gc
from _helpers import Problem, triton_interpreting
from _strategies import chains, examples, seeds
from test_fused import (CNN, CUDA, DEVICE, MANY, _assert_unchanged,  # noqa: F401
                        _counted_launches, _eager_and_replayed, _interpreter,
                        _NoHostReads, _ns, _plan, _tensors, gbt)
from test_rule_fast_path import _synced_steps

torch = pytest.importorskip("torch")

with triton_interpreting(CUDA):
    fused = importlib.import_module("gsgd_backends.fused")
    fused_adam = importlib.import_module("gsgd_backends.fused_adam")

#: AdamRule's hyperparameters (lr aside), as fused_adam_step_ takes them too.
RULES = {"adam": dict(),
         "adam-l2": dict(weight_decay=0.1),
         "adamw": dict(weight_decay=0.1, decoupled=True),
         "amsgrad": dict(betas=(0.8, 0.99), weight_decay=0.1, decoupled=True, amsgrad=True),
         "amsgrad-l2": dict(weight_decay=0.05, amsgrad=True)}
LR = 0.01


def _rule(name: str) -> gc.AdamRule:
    return gc.AdamRule(LR, **RULES[name])


def _fused_step(chain, name, maximize=False):
    """A step for _synced_steps: the fused step of ``chain`` alone; with ``maximize``, on
    the negated gradients (the core steps on the gradients themselves)."""
    sign = -1.0 if maximize else 1.0

    def step(state, A, Ab, G, Gb):
        fused_adam.fused_adam_step_(
            _plan([chain], A[0]), [A], [Ab], [[sign * g for g in G]],
            [[None if g is None else sign * g for g in Gb]], LR, [state], maximize=maximize,
            **RULES[name])
        return True
    return step


# No shrinking: an interpreted step takes a second, and the failing example is small anyway.
@settings(max_examples=examples(2), deadline=None,
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(chain=chains(max_depth=4, max_width=5, max_slots=4), seed=seeds,
       name=st.sampled_from(sorted(RULES)), dtype=st.sampled_from(["float64", "float32"]),
       maximize=st.booleans())
@example(chain=CNN, seed=3, name="amsgrad", dtype="float64", maximize=True)
def test_fused_adam_step_equals_the_core(chain, seed, name, dtype, maximize):
    """Three fused steps against path_update with AdamRule, each from the core's state
    (weights, biases, moments, step count), within the rule's conditioning
    (_conditioning: float64 to rounding, float32 within 2e-4), on drawn chains (custom
    skeletons, skeleton scales, convolution slots, biases) and a conv-flatten chain with
    biases; L2 and decoupled weight decay, AMSGrad, ``maximize`` on negated gradients."""
    assert _synced_steps(_ns(dtype), chain, Problem(chain, seed), _rule(name), 3,
                         step=_fused_step(chain, name, maximize))


def _setup(chains_, rule, seed=0):
    """Per chain: the host problem, then weights, biases, gradients, bias gradients and
    the rule's state (torch, float64, on the tests' device)."""
    out = []
    for i, c in enumerate(chains_):
        pb = Problem(c, seed + i)
        G, Gb = pb.grads()
        W, b = _tensors(pb.W), _tensors(pb.b)
        out.append((pb, W, b, _tensors(G), _tensors(Gb), gc.path_init(c, rule, W, b)))
    return out


def _step_all(plan, parts, name, lr=LR, **kw):
    fused_adam.fused_adam_step_(plan, *[[p[i] for p in parts] for i in range(1, 5)], lr,
                                [p[5] for p in parts], **RULES[name], **kw)


def _snapshot(parts):
    return [[None if t is None else t.clone()
             for t in [*p[1], *p[2], *(a for bufs in p[5].buffers for a in bufs), p[5].count]]
            for p in parts]


def test_a_chain_with_a_nan_gradient_is_skipped_alone_and_found_inf_skips_all():
    """Two chains in one plan (AMSGrad, L2 weight decay): a NaN gradient in one skips that
    chain only (weights, biases, moments and count unchanged) while the other takes the
    core's first step; a set ``found_inf`` skips every chain; a clear one does not."""
    rule = _rule("amsgrad-l2")
    parts = _setup(MANY, rule)
    plan = _plan(MANY, parts[0][1][0])
    parts[1][3][1][0, 0, 0] = float("nan")
    before = _snapshot(parts)
    _step_all(plan, parts, "amsgrad-l2")
    _assert_unchanged(before, _snapshot(parts), [1])
    pb, W, b, _, _, state = parts[0]
    want_W, want_b, want = gc.path_update(MANY[0], rule, gc.path_init(MANY[0], rule, pb.W,
                                                                       pb.b),
                                          pb.W, pb.b, *pb.grads())
    got = W + [x for x in b if x is not None] + [a for bufs in state.buffers for a in bufs]
    expected = list(want_W) + [x for x in want_b if x is not None] + [
        a for bufs in want.buffers for a in bufs]
    for x, y in zip(got, expected, strict=True):
        np.testing.assert_allclose(x.cpu().numpy(), y, rtol=1e-12, atol=1e-12)
    assert [int(p[5].count) for p in parts] == [1, 0]
    before = _snapshot(parts)
    _step_all(plan, parts, "amsgrad-l2", found_inf=torch.ones(1, device=DEVICE))
    _assert_unchanged(before, _snapshot(parts), range(2))
    _step_all(plan, parts, "amsgrad-l2", found_inf=torch.zeros(1, device=DEVICE))
    assert [int(p[5].count) for p in parts] == [2, 0]


def test_a_fused_adam_step_is_three_launches_and_reads_nothing_back(monkeypatch):
    """Chains of 6 and 3 layers in one plan, AMSGrad with decoupled decay at a device
    learning rate and a clear ``found_inf``: each step launches the three kernels once and
    no ATen operation (the first after building the plan at most the pointer tables'
    copies: at most 8 in all), while ``item``, ``bool``, ``tolist``, ``cpu``, ... of any
    tensor raise; the steps take place."""
    group = [gc.Chain.mlp([1] * 7, bias=False), MANY[1]]
    parts = _setup(group, _rule("amsgrad"))
    plan = fused.FusedPlan([gbt.ON_DEVICE.plan(c, parts[0][1][0]) for c in group])
    counting = _counted_launches(monkeypatch, fused)
    lr = torch.tensor(LR, dtype=torch.float64, device=DEVICE)
    found_inf = torch.zeros(1, device=DEVICE)
    totals = []
    for _ in range(2):
        counting.aten, counting.launches = [], []
        with counting, _NoHostReads():
            _step_all(plan, parts, "amsgrad", lr=lr, found_inf=found_inf)
        assert counting.launches == ["read_pass", "vector_stage", "write_pass"]
        totals.append(len(counting.aten) + len(counting.launches))
    assert totals[0] <= 8, counting.aten
    assert totals[1] == 3, counting.aten
    assert [int(p[5].count) for p in parts] == [2, 2]


@pytest.mark.parametrize("change, message", [
    (lambda p: p[5]._replace(buffers=p[5].buffers[:1]), "RuleState with the buffers"),
    (lambda p: p[5]._replace(buffers=(p[5].buffers[0], tuple(
        a.float() for a in p[5].buffers[1]))), "layer 1: the exp_avg_sq buffer.*float32"),
    (lambda p: p[5]._replace(buffers=tuple(bufs[:-1] for bufs in p[5].buffers)),
     r"^states\[0\]: exp_avg holds 3 arrays; the chain's 2 layers and 2 biases need 4$"),
    (lambda p: gc.gsgd_init(MANY[0], p[1], p[2]), r"^states\[0\]: G-Adam needs a RuleState"),
    (lambda p: dict(states=None), r"^states: G-Adam needs one gsgd_core.path_init"),
    (lambda p: dict(states=[p[5]] * 2), r"^states: the plan steps 1 chains, got 2 lists$"),
    (lambda p: dict(biases=[]), r"^biases: the plan steps 1 chains, got 0 lists$"),
    (lambda p: dict(lr=-0.1), r"^lr must be finite and >= 0, got -0.1$"),
    (lambda p: dict(grad_scale=torch.ones(2, device=DEVICE)),
     "grad_scale must be a one-element tensor"),
    (lambda p: p[5]._replace(count=p[5].count.long()), "int32"),
    (lambda p: p[3].__setitem__(1, p[3][1][:, :1]), "layer 2"),
    (lambda p: dict(betas=(1.0, 0.999)), "betas"),
])
def test_bad_input_is_refused_before_any_launch(monkeypatch, change, message):
    """States of another rule, moments of another dtype or number, a counter of another
    dtype, the core's errors naming the layer, and Adam's own hyperparameter checks:
    ``ValueError`` before any kernel runs."""
    parts = [list(p) for p in _setup(MANY[:1], _rule("adam"))]
    plan = _plan(MANY[:1], parts[0][1][0])
    out = change(parts[0])
    kw = out if isinstance(out, dict) else {}
    if isinstance(out, (gc.RuleState, gc.GSGDState)):
        parts[0][5] = out
    given = dict(weights=[parts[0][1]], biases=[parts[0][2]], grads=[parts[0][3]],
                 bias_grads=[parts[0][4]], lr=LR, states=[parts[0][5]])
    given.update((k, kw.pop(k)) for k in list(kw) if k in given)
    monkeypatch.setattr(fused, "launch", lambda *a, **k: pytest.fail("a kernel ran"))
    with pytest.raises(ValueError, match=message):
        fused_adam.fused_adam_step_(plan, given["weights"], given["biases"], given["grads"],
                                    given["bias_grads"], given["lr"], given["states"],
                                    **{**RULES["adam"], **kw})


def test_a_one_element_tensor_lr_steps_as_the_number():
    """``lr`` as a one-element device tensor of shape ``(1,)`` (a schedule's, read on the
    device) steps as the same number."""
    runs = [_setup(MANY, _rule("amsgrad")), _setup(MANY, _rule("amsgrad"))]
    plan = _plan(MANY, runs[0][0][1][0])
    _step_all(plan, runs[0], "amsgrad", lr=torch.tensor([LR], dtype=torch.float64, device=DEVICE))
    _step_all(plan, runs[1], "amsgrad")
    for a, e in zip(_snapshot(runs[0]), _snapshot(runs[1])):
        for x, y in zip(a, e):
            assert (x is None and y is None) or torch.equal(x, y)


def test_chains_without_biases_step_alike_given_none_or_lists_of_none():
    """``biases=None`` (and no bias gradients) for a plan whose chains have no bias is the
    same step as lists of ``None``; a state with too few moments says what it needs."""
    rule = _rule("adamw")
    runs = [_setup(MANY[1:], rule), _setup(MANY[1:], rule)]
    plan = _plan(MANY[1:], runs[0][0][1][0])
    (_, W, b, G, Gb, state), = runs[0]
    before = _snapshot(runs[0])[0]
    fused_adam.fused_adam_step_(plan, [W], None, [G], None, LR, [state], **RULES["adamw"])
    _step_all(plan, runs[1], "adamw")
    assert all(x is None for x in runs[1][0][2]) and not torch.equal(W[0], before[0])
    for a, e in zip(_snapshot(runs[0])[0], _snapshot(runs[1])[0]):
        if a is not None:
            assert torch.equal(a, e)
    short = state._replace(buffers=tuple(bufs[:-1] for bufs in state.buffers))
    with pytest.raises(ValueError, match=r"^states\[0\]: exp_avg holds 2 arrays; the chain's "
                                         r"3 layers and 0 biases need 3$"):
        fused_adam.fused_adam_step_(plan, [W], None, [G], None, LR, [short])


def test_column_sums_from_the_backward_step_as_the_read_pass_and_a_bad_check_skips():
    """Column sums and a gradient check handed in (DESIGN §12): the G-AdamW step equals the
    one that sums ``W * grad`` itself, with ``maximize``; a non-finite check skips."""
    rule = _rule("adamw")
    taken, given = _setup([CNN], rule), _setup([CNN], rule)
    _, W, _, G, _, _ = given[0]
    sums = [(w * g).reshape(CNN.layer_shape(l)).sum(dim=(0, 2))
            for l, w, g in zip(range(2, CNN.L + 1), W[1:], G[1:])]
    check = sum(g.sum() for g in G)
    _step_all(_plan([CNN], W[0]), taken, "adamw", maximize=True)
    plan = _plan([CNN], W[0])
    _step_all(plan, given, "adamw", maximize=True, column_sums=[sums],
              gradient_check=[check])
    for a, b in zip(_snapshot(taken)[0], _snapshot(given)[0]):
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-13)
    before = _snapshot(given)
    _step_all(plan, given, "adamw", maximize=True, column_sums=[sums],
              gradient_check=[check * float("nan")])
    _assert_unchanged(before, _snapshot(given), [0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_steps_as_the_core_in_float32(dtype):
    """float16 and bfloat16 weights and biases with float32 moments (as GAdam keeps them)
    step as the core steps them, computed in float32: weights within one unit of their last
    place, moments to float32 rounding."""
    chain, rule = MANY[0], _rule("adam-l2")
    pb = Problem(chain, 5)
    G, Gb = pb.grads()

    def half(arrays):
        return [None if a is None else torch.tensor(a, dtype=dtype, device=DEVICE)
                for a in arrays]
    W, b, Gt, Gbt = half(pb.W), half(pb.b), half(G), half(Gb)
    state = gc.path_init(chain, rule, W, b)
    assert state.buffers[0][0].dtype == torch.float32
    want_W, want_b, want = gc.path_update(chain, rule, gc.path_init(chain, rule, W, b), W, b,
                                          Gt, Gbt)
    fused_adam.fused_adam_step_(_plan([chain], W[0]), [W], [b], [Gt], [Gbt], LR, [state],
                                **RULES["adam-l2"])
    for got, expected in zip(W + b, list(want_W) + list(want_b)):
        if expected is not None:
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), expected.float(), atol=0,
                                       rtol=torch.finfo(dtype).eps)
    for got, expected in zip((a for bufs in state.buffers for a in bufs),
                             (a for bufs in want.buffers for a in bufs)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-9)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs and stream synchronisation need a GPU")
def test_a_fused_adam_step_never_synchronises_and_replays_from_a_cuda_graph():
    """Two chains, AMSGrad with decoupled decay, a device learning rate and GradScaler's
    ``found_inf``: eager steps under torch's sync debug mode "error" and the same steps
    replayed from one captured CUDA graph agree bit for bit (bias corrections from the
    device counter), including a learning rate changed on the device between replays and a
    replay skipped by a set ``found_inf``."""
    rule = _rule("amsgrad")
    eager, captured = _setup(MANY, rule), _setup(MANY, rule)
    plans = _plan(MANY, eager[0][1][0]), _plan(MANY, captured[0][1][0])
    lrs = [torch.tensor(LR, dtype=torch.float64, device=DEVICE) for _ in range(2)]
    founds = [torch.zeros(1, device=DEVICE) for _ in range(2)]

    def step(i):
        _step_all(plans[i], (eager, captured)[i], "amsgrad", lr=lrs[i], found_inf=founds[i])
    _eager_and_replayed(step, lrs, founds,
                        ((0.01, 0.0), (0.005, 0.0), (0.005, 1.0), (0.02, 0.0)))
    for a, b in zip(_snapshot(eager), _snapshot(captured)):
        for x, y in zip(a, b):
            assert x is None or torch.equal(x, y)
    assert [int(p[5].count) for p in eager] == [4, 4]

