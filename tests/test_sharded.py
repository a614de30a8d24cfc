"""gsgd_backends.sharded: steps of chains split by rows over simulated processes (threads
that sum their vectors at a barrier) against the core's whole-chain steps, on drawn chains,
skeletons and splits (uneven and empty shards included)."""

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gsgd_backends as gb
import gsgd_core as gc
from gsgd_backends.sharded import RowShard, sharded_gsgd_update_, sharded_path_update_
from _helpers import Problem, assert_close, reverse_axes
from _conditioning import (assert_buffers_close, assert_step_close, gradient_rounding,
                          gsgd_tolerance, step_tolerance)
from _strategies import chains, examples, seeds

torch = pytest.importorskip("torch")
from gsgd_backends.torch import KERNELS, ON_DEVICE  # noqa: E402 - needs torch

LIBS = {"numpy": (lambda a: a.copy(), lambda a: np.asarray(a)),
        "torch": (lambda a: torch.tensor(a), lambda a: a.numpy()),
        "torch-device": (lambda a: torch.tensor(a), lambda a: a.numpy()),
        "torch-cuda": (lambda a: torch.tensor(a, device="cuda"), lambda a: a.cpu().numpy())}
LIB_PARAMS = [pytest.param(k, marks=pytest.mark.skipif(
    k == "torch-cuda" and not torch.cuda.is_available(), reason="no CUDA device")) for k in LIBS]


def _kernels(lib, array):
    """The library's kernels; ``torch-device``: the plan GPU tensors take (torch's kernels
    throughout, no host read in the bulk), run on CPU tensors. (The ``torch`` plan of CPU
    tensors computes on NumPy views of them.)"""
    if lib == "torch-device":
        return ON_DEVICE
    return gb.kernels_for(array)
HYPERS = [dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3), dict(lr=0.05),
          dict(lr=0.05, momentum=0.9), dict(lr=0.05, weight_decay=1e-3)]


def run_processes(world: int, fn) -> list:
    """``fn(rank, reduce)`` on ``world`` threads running at once (the kernels keep their
    scratch buffers per thread); ``reduce`` sums a vector over them."""
    barrier = threading.Barrier(world)
    box, out, errors = [None] * world, [None] * world, []

    def work(rank):
        def reduce(v):
            box[rank] = v + 0
            barrier.wait()
            total = box[0]
            for x in box[1:]:
                total = total + x
            barrier.wait()
            return total

        try:
            out[rank] = fn(rank, reduce)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


@st.composite
def splits(draw, chain, world):
    """Per process, per layer ``(r0, r1)``: contiguous rows, any sizes (empty allowed)."""
    cuts = []
    for l in range(1, chain.L + 1):
        n = chain.sizes[l]
        inner = sorted(draw(st.lists(st.integers(0, n), min_size=world - 1,
                                     max_size=world - 1)))
        cuts.append([0] + inner + [n])
    return [[(c[r], c[r + 1]) for c in cuts] for r in range(world)]


def _rows(arrays, rows, to):
    return [None if a is None else to(a[r0:r1]) for a, (r0, r1) in zip(arrays, rows)]


def _join(parts, from_):
    return [None if parts[0][l] is None else np.concatenate([from_(p[l]) for p in parts])
            for l in range(len(parts[0]))]


@pytest.mark.parametrize("lib", LIB_PARAMS)
@settings(max_examples=examples(15))
@given(data=st.data(), chain=chains(max_depth=4), seed=seeds, world=st.integers(1, 4),
       hyper=st.sampled_from(HYPERS))
def test_sharded_gsgd_equals_the_core(lib, data, chain, seed, world, hyper):
    """3 G-SGD steps (plain; momentum; weight decay; all with Nesterov) on row shards, each
    from the core's state, equal the core's (:mod:`_conditioning`: path values and
    buffers, and the weights where no tau path ratio nears 0)."""
    to, from_ = LIBS[lib]
    split = data.draw(splits(chain, world))
    pb = Problem(chain, seed)
    W, b, state = pb.W, pb.b, gc.gsgd_init(chain, pb.W, pb.b)
    rest = {k: v for k, v in hyper.items() if k != "lr"}
    for count in range(3):
        G, Gb = pb.grads(W, b)
        tol, tol_m = gsgd_tolerance(chain, rest, hyper["lr"], count, W, b, G, Gb, state)
        locs = [dict(W=_rows(W, r, to), b=_rows(b, r, to),
                     st=gc.GSGDState(tuple(_rows(list(state.momentum), r, to)),
                                     tuple(_rows(list(state.bias_momentum), r, to)),
                                     to(np.asarray(count)))) for r in split]

        def step(rank, reduce, G=G, Gb=Gb, locs=locs):
            loc, rows = locs[rank], split[rank]
            shard = RowShard(chain, rows, reduce)
            return sharded_gsgd_update_(_kernels(lib, loc["W"][0]), shard, loc["st"],
                                        loc["W"], loc["b"], _rows(G, rows, to),
                                        _rows(Gb, rows, to), **hyper)

        assert run_processes(world, step) == [True] * world
        old = (W, b)
        W, b, state = gc.gsgd_update(chain, state, W, b, G, Gb, **hyper)
        got = (_join([p["W"] for p in locs], from_), _join([p["b"] for p in locs], from_))
        assert_step_close(chain, old, got, (W, b), 1e-12, tol, f"step {count}")
        if rest.get("momentum"):
            assert_buffers_close(
                _join([p["st"].momentum for p in locs], from_)
                + _join([p["st"].bias_momentum for p in locs], from_),
                list(state.momentum) + list(state.bias_momentum), 1e-12, tol_m,
                f"step {count} momentum")


@pytest.mark.parametrize("lib", LIB_PARAMS)
@settings(max_examples=examples(10))
@given(data=st.data(), chain=chains(max_depth=4), seed=seeds, world=st.integers(1, 4))
def test_sharded_rule_equals_the_core(lib, data, chain, seed, world):
    """3 G-AdamW steps (amsgrad) on row shards, each from the core's state, equal the
    core's path_update, moments too, within G-AdamW's conditioning (:mod:`_conditioning`:
    a tau path whose gradient cancels is rounding that Adam's ``lr / eps`` slope scales)."""
    to, from_ = LIBS[lib]
    split = data.draw(splits(chain, world))
    rule = gc.adamw_rule(0.01, weight_decay=0.1, amsgrad=True)
    pb = Problem(chain, seed)
    W, b = pb.W, pb.b
    state = gc.path_init(chain, rule, W, b)
    n_w = chain.L
    for count in range(3):
        G, Gb = pb.grads(W, b)
        D, dD, V = gradient_rounding(chain, W, b, G, Gb)
        tol, tol_bufs = step_tolerance(rule, count, D, dD, V, state.buffers)
        locs = []
        for rows in split:
            bias_rows = [r for r, x in zip(rows, b) if x is not None]
            bufs = tuple(tuple(_rows(list(buf[:n_w]), rows, to)
                               + _rows(list(buf[n_w:]), bias_rows, to))
                         for buf in state.buffers)
            locs.append(dict(W=_rows(W, rows, to), b=_rows(b, rows, to),
                             st=gc.RuleState(bufs, to(np.asarray(count, dtype=np.int32)))))

        def step(rank, reduce, G=G, Gb=Gb, locs=locs):
            loc, rows = locs[rank], split[rank]
            shard = RowShard(chain, rows, reduce)
            return sharded_path_update_(_kernels(lib, loc["W"][0]), shard, rule, loc["st"],
                                        loc["W"], loc["b"], _rows(G, rows, to),
                                        _rows(Gb, rows, to))

        assert run_processes(world, step) == [True] * world
        old = (W, b)
        W, b, state = gc.path_update(chain, rule, state, W, b, G, Gb)
        got = (_join([p["W"] for p in locs], from_), _join([p["b"] for p in locs], from_))
        assert_step_close(chain, old, got, (W, b), 1e-12, tol, f"step {count}")
        for j, buf in enumerate(state.buffers):
            got_buf = [np.concatenate([from_(p["st"].buffers[j][i]) for p in locs])
                       for i in range(len(buf))]
            assert_buffers_close(got_buf, list(buf), 1e-12, tol_bufs[j], f"buffer {j}")


def _declined(world, poison, rule=None):
    """One G-SGD step (or one of ``rule``) on shards where ``poison(rank, local arrays)``
    spoils one process's arrays: every process must decline, with nothing written
    anywhere (moments included)."""
    chain = gc.Chain.mlp([4, 6, 5, 3])
    pb = Problem(chain, 0)
    state = None if rule is None else gc.path_init(chain, rule, pb.W, pb.b)
    G, Gb = pb.grads()
    split = [[(r * n // world, (r + 1) * n // world) for n in chain.sizes[1:]]
             for r in range(world)]
    locs = [dict(W=_rows(pb.W, r, np.copy), b=_rows(pb.b, r, np.copy),
                 G=_rows(G, r, np.copy), Gb=_rows(Gb, r, np.copy)) for r in split]
    for loc, rows in zip(locs, split):
        if state is not None:  # moments made non-zero, so that a write would show
            loc["M"] = [_rows([np.full_like(a, 0.5) for a in buf[:chain.L]], rows, np.copy)
                        + _rows([np.full_like(a, 0.5) for a in buf[chain.L:]], rows, np.copy)
                        for buf in state.buffers]
    for rank, loc in enumerate(locs):
        poison(rank, loc)
    before = [{k: [None if a is None else a.copy() for a in v] for k, v in loc.items()
               if k != "M"} for loc in locs]
    moments = [[[m.copy() for m in buf] for buf in loc.get("M", [])] for loc in locs]

    def step(rank, reduce):
        loc = locs[rank]
        shard = RowShard(chain, split[rank], reduce)
        kernels = gb.kernels_for(loc["W"][0])
        if rule is not None:
            st_ = gc.RuleState(tuple(tuple(m) for m in loc["M"]), np.asarray(1, np.int32))
            return sharded_path_update_(kernels, shard, rule, st_, loc["W"], loc["b"],
                                        loc["G"], loc["Gb"])
        return sharded_gsgd_update_(kernels, shard, None, loc["W"], loc["b"], loc["G"],
                                    loc["Gb"], lr=0.1)

    assert run_processes(world, step) == [False] * world
    for loc, old, old_m in zip(locs, before, moments):
        for k in ("W", "b"):
            for a, o in zip(loc[k], old[k]):
                assert np.array_equal(a, o, equal_nan=True)
        for buf, old_buf in zip(loc.get("M", []), old_m):
            assert all(np.array_equal(a, o) for a, o in zip(buf, old_buf))


RULES = {"gsgd": None, "adamw": gc.adamw_rule(0.01, amsgrad=True)}


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("layer", [0, 1])
def test_a_nan_on_one_process_declines_everywhere(rule, layer):
    """A NaN in one process's gradient of layer 1 (seen only through its sum) or layer 2."""
    def poison(rank, loc):
        if rank == 2:
            loc["G"][layer][0, 0] = np.nan
    _declined(3, poison, RULES[rule])


@pytest.mark.parametrize("rule", list(RULES))
def test_one_process_unable_to_step_in_place_declines_everywhere(rule):
    def poison(rank, loc):  # a weight that is not contiguous cannot be viewed in place
        if rank == 1:
            loc["W"][0] = np.asfortranarray(loc["W"][0])
    _declined(3, poison, RULES[rule])


def test_a_buffer_unable_to_be_written_in_place_declines_everywhere():
    def poison(rank, loc):
        if rank == 0:
            loc["M"][1][0] = np.asfortranarray(loc["M"][1][0])
    _declined(3, poison, RULES["adamw"])


def test_a_momentum_buffer_unable_to_be_written_in_place_declines():
    """G-SGD's momentum buffer of layer 2 not contiguous: the step is handed back, with
    nothing written (the buffer included)."""
    chain = gc.Chain.mlp([4, 6, 5, 3])
    rows = [(0, n) for n in chain.sizes[1:]]
    loc = _bad(chain, rows)
    pb = Problem(chain, 0)
    state = gc.gsgd_init(chain, pb.W, pb.b)
    momentum = [np.full_like(m, 0.5) for m in state.momentum]
    momentum[1] = np.asfortranarray(momentum[1])
    state = state._replace(momentum=tuple(momentum), step=np.asarray(1, np.int32))
    before = [a.copy() for a in loc["weights"] + loc["biases"] + momentum]
    done = sharded_gsgd_update_(gb.kernels_for(pb.W[0]), RowShard(chain, rows, lambda v: v),
                                state, *loc.values(), lr=0.1, momentum=0.9)
    assert done is False
    assert all(np.array_equal(a, b)
               for a, b in zip(loc["weights"] + loc["biases"] + momentum, before))


@pytest.mark.parametrize("rule", list(RULES))
def test_half_precision_declines_everywhere(rule):
    def poison(rank, loc):
        for k in ("W", "G", "b", "Gb"):
            loc[k] = [a.astype(np.float16) for a in loc[k]]
    _declined(2, poison, RULES[rule])


@pytest.mark.parametrize("rule", list(RULES))
def test_half_precision_declines_every_step_not_only_the_first(rule):
    """A shard keeps a valid call's checks for the next call with the same arrays (a
    training loop's): the second half-precision step is declined as the first was."""
    chain = gc.Chain.mlp([4, 6, 5, 3])
    rows = [(0, n) for n in chain.sizes[1:]]
    loc = {k: [a.astype(np.float16) for a in v] for k, v in _bad(chain, rows).items()}
    before = [a.copy() for a in loc["weights"] + loc["biases"]]
    shard = RowShard(chain, rows, lambda v: v)
    assert [_local_step(chain, shard, RULES[rule], loc) for _ in range(2)] == [False, False]
    assert all(np.array_equal(a, b) for a, b in zip(loc["weights"] + loc["biases"], before))


def _bad(chain, rows, **change):
    """A call's local arrays of ``chain`` (rows ``rows``), with the entries in ``change``
    (name -> (layer, array)) replaced."""
    pb = Problem(chain, 0)
    G, Gb = pb.grads()
    loc = dict(weights=_rows(pb.W, rows, np.copy), biases=_rows(pb.b, rows, np.copy),
               grads=_rows(G, rows, np.copy), bias_grads=_rows(Gb, rows, np.copy))  # call order
    for name, (l, a) in change.items():
        loc[name][l] = a
    return loc


@pytest.mark.parametrize("rule", ["gsgd", "adamw"])
@pytest.mark.parametrize("change, message", [
    (dict(weights=(1, np.zeros((2, 6)))), r"^layer 2: weights\[1\] has shape \(2, 6\), but "
     r"this process holds its rows \[0, 3\) of 6 entries$"),
    (dict(weights=(0, np.zeros((2, 5)))), r"^layer 1: weights\[0\] has shape \(2, 5\), but "
     r"this process holds its rows \[2, 4\) of 4 entries$"),
    (dict(grads=(2, np.zeros((3,)))), r"^layer 3: grads\[2\] has shape \(3,\), but this "
     r"process holds its rows \[1, 3\) of 5 entries$"),
    (dict(biases=(0, np.zeros(4))), r"^layer 1: biases\[0\] has shape \(4,\), but this "
     r"process holds its rows \[2, 4\)$"),
    (dict(bias_grads=(1, np.zeros(2))), r"^layer 2: bias_grads\[1\] has shape \(2,\), but "
     r"this process holds its rows \[0, 3\)$"),
    (dict(weights=(2, np.zeros((2, 5), np.float32))), r"^all arrays must share the weights' "
     r"dtype float64; found an array of dtype float32 and shape \(2, 5\)$"),
    (dict(biases=(0, np.zeros(2, np.float32))), r"^all arrays must share the weights' dtype "
     r"float64; found an array of dtype float32 and shape \(2,\)$"),
    (dict(grads=(0, np.zeros((2, 4), np.int64))), "^all arrays must share the weights' dtype"),
    (dict(weights=(0, np.zeros((2, 4), np.int64))), r"^weights must be real floating point, "
     r"got dtype int64$"),
    (dict(weights=(0, [[0.0] * 4] * 2)), r"^layer 1: weights\[0\] is a list, not an array$"),
    (dict(bias_grads=(2, (0.0, 0.0))), r"^layer 3: bias_grads\[2\] is a tuple, not an array$"),
    (dict(bias_grads=(2, None)), r"^layer 3: the layer has a bias but bias_grads\[2\] is None$"),
    (dict(grads=(1, torch.zeros(3, 6, dtype=torch.float64))), "^all arrays must come from "
     "one array namespace: Multiple namespaces"),
])
def test_local_rows_are_checked_as_the_core_checks_a_chain(rule, change, message):
    """Every array of a sharded step is checked before any is read: the local rows' shapes,
    one namespace, one real floating dtype (the weights'), one device."""
    chain = gc.Chain.mlp([4, 6, 5, 3])
    rows = [(2, 4), (0, 3), (1, 3)]
    loc = _bad(chain, rows, **change)
    shard = RowShard(chain, rows, lambda v: pytest.fail("a refused step reduced a vector"))
    with pytest.raises(ValueError, match=message):
        _local_step(chain, shard, RULES[rule], loc)


def _local_step(chain, shard, rule, loc):
    kernels = gb.kernels_for(np.zeros(1))
    if rule is None:
        return sharded_gsgd_update_(kernels, shard, None, *loc.values(), lr=0.1)
    pb = Problem(chain, 0)
    state = gc.path_init(chain, rule, pb.W, pb.b)
    local = gc.RuleState(tuple(tuple(_rows(buf[:chain.L], shard.rows, np.copy)
                                     + _rows(buf[chain.L:], shard.rows, np.copy))
                               for buf in state.buffers), state.count)
    return sharded_path_update_(kernels, shard, rule, local, *loc.values())


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("grads", [None, np.zeros((3, 6, 4))], ids=["None", "array"])
def test_a_first_step_refuses_gradients_that_are_not_a_list(rule, grads):
    """Gradients given as ``None`` or as one array, on a shard's first call."""
    chain = gc.Chain.mlp([4, 6, 5, 3])
    rows = [(0, n) for n in chain.sizes[1:]]
    loc = _bad(chain, rows)
    loc["grads"] = grads
    shard = RowShard(chain, rows, lambda v: pytest.fail("a refused step reduced a vector"))
    with pytest.raises(ValueError, match=r"^grads must be a list with one entry per layer "
                       rf"\(3\), got {type(grads).__name__}$"):
        _local_step(chain, shard, RULES[rule], loc)


def test_a_weight_of_one_axis_is_refused_where_each_row_holds_one_entry():
    """A layer of one input unit: its rows, of one entry each, still come as a 2-D array."""
    chain = gc.Chain.mlp([1, 3, 2])
    rows = [(0, 3), (0, 2)]
    loc = _bad(chain, rows, weights=(0, np.zeros(3)))
    shard = RowShard(chain, rows, lambda v: pytest.fail("a refused step reduced a vector"))
    with pytest.raises(ValueError, match=r"^layer 1: weights\[0\] has shape \(3,\), but this "
                       r"process holds its rows \[0, 3\) of 1 entries$"):
        _local_step(chain, shard, None, loc)


def test_momentum_without_a_state_is_refused():
    chain = gc.Chain.mlp([4, 6, 5, 3])
    rows = [(0, n) for n in chain.sizes[1:]]
    shard = RowShard(chain, rows, lambda v: pytest.fail("a refused step reduced a vector"))
    with pytest.raises(ValueError, match=r"^momentum needs a state: create one with "
                       r"gsgd_init\(chain, weights, biases\)$"):
        sharded_gsgd_update_(gb.kernels_for(np.zeros(1)), shard, None,
                             *_bad(chain, rows).values(), lr=0.1, momentum=0.9)


def test_a_missing_buffer_is_refused_naming_it():
    """A rule's state with ``None`` for a layer's buffer (biases only may be ``None``)."""
    chain = gc.Chain.mlp([4, 6, 5, 3])
    rows = [(0, n) for n in chain.sizes[1:]]
    pb = Problem(chain, 0)
    state = gc.path_init(chain, RULES["adamw"], pb.W, pb.b)
    buffers = [list(buf) for buf in state.buffers]
    buffers[0][1] = None
    shard = RowShard(chain, rows, lambda v: pytest.fail("a refused step reduced a vector"))
    with pytest.raises(ValueError, match=r"^layer 2: buffers\[0\]\[1\] is a NoneType, not an "
                       r"array$"):
        sharded_path_update_(gb.kernels_for(pb.W[0]), shard, RULES["adamw"],
                             gc.RuleState(tuple(map(tuple, buffers)), state.count),
                             *_bad(chain, rows).values())


def test_a_sharded_step_needs_one_entry_per_layer():
    chain = gc.Chain.mlp([4, 6, 5, 3])
    rows = [(0, 6), (0, 5), (0, 3)]
    loc = _bad(chain, rows)
    shard = RowShard(chain, rows, lambda v: v)
    loc["grads"] = loc["grads"][:2]
    with pytest.raises(ValueError, match="^grads has 2 entries, but the chain has 3 layers$"):
        _local_step(chain, shard, None, loc)


@pytest.mark.parametrize("rows, match", [
    ([(0, 6), (0, 5)], "one \\(start, stop\\) per layer"),
    ([(0, 7), (0, 5), (0, 3)], "layer 1: rows \\[0, 7\\) outside its 6"),
    ([(0, 6), (4, 2), (0, 3)], "layer 2: rows \\[4, 2\\)"),
])
def test_row_shard_refuses_bad_rows(rows, match):
    with pytest.raises(ValueError, match=match):
        RowShard(gc.Chain.mlp([4, 6, 5, 3]), rows, lambda v: v)


def test_two_threads_stepping_at_once_get_the_sequential_numbers():
    """Two G-SGD momentum steps in two threads at once, on layers large enough for the
    block kernels and their scratch buffers (per thread): each equals its run alone."""
    chain = gc.Chain.mlp([300, 400, 300, 10])
    problems = [Problem(chain, s) for s in (0, 1)]
    hyper = dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4)

    def run(pb, steps=4):
        W, b = [w.copy() for w in pb.W], [x.copy() for x in pb.b]
        st = gc.gsgd_init(chain, W, b)
        G, Gb = pb.grads()
        for _ in range(steps):
            assert gb.gsgd_update_(chain, st, W, b, G, Gb, **hyper)
        return W

    alone = [run(pb) for pb in problems]
    together = run_processes(2, lambda rank, reduce: run(problems[rank]))
    for a, t in zip(alone, together):
        for x, y in zip(a, t):
            assert np.array_equal(x, y)



def test_a_shard_follows_its_arrays_to_another_plan():
    """One ``RowShard`` stepped with float64 NumPy arrays, then float32 torch tensors (a
    model moved to another dtype), then float64 tensors on the device plan: each step
    equals the core's (the shard rebuilds its plan and its local indices each time)."""
    chain = gc.Chain.mlp([4, 6, 5, 3])
    shard = RowShard(chain, [(0, n) for n in chain.sizes[1:]], lambda v: v)
    pb = Problem(chain, 3)
    G, Gb = pb.grads()
    plans = []
    for kernels, to, rtol in ((gb.kernels_for(pb.W[0]), np.copy, 1e-12),
                              (KERNELS, lambda a: torch.tensor(a, dtype=torch.float32), 1e-5),
                              (ON_DEVICE, torch.tensor, 1e-12)):
        W, b, G_, Gb_ = ([to(a) for a in arrays] for arrays in (pb.W, pb.b, G, Gb))
        want_W, want_b, _ = gc.gsgd_update(chain, None, W, b, G_, Gb_, lr=0.1)
        assert sharded_gsgd_update_(kernels, shard, None, W, b, G_, Gb_, lr=0.1)
        plans.append(shard.plan(kernels, W[0]))
        for got, want in zip(W + b, list(want_W) + list(want_b)):
            assert_close(np.asarray(got), np.asarray(want), rtol)
    assert len({id(p) for p in plans}) == 3
    # the same kernels: the plan is kept while it fits, rebuilt for another dtype
    w64, w32 = torch.tensor(pb.W[0]), torch.tensor(pb.W[0], dtype=torch.float32)
    kept = shard.plan(KERNELS, w64)
    assert shard.plan(KERNELS, w64) is kept and kept.fits(chain, w64)
    assert shard.plan(KERNELS, w32).fits(chain, w32)
    assert shard.plan(KERNELS, w64).fits(chain, w64)


@pytest.mark.parametrize("rule", list(RULES))
def test_a_chain_without_biases(rule):
    """``biases=None`` (and no bias gradients): two processes step as the core does."""
    chain = gc.Chain.mlp([4, 6, 5, 3], bias=False)
    pb = Problem(chain, 5)
    G, _ = pb.grads()
    r = RULES[rule]
    state = None if r is None else gc.path_init(chain, r, pb.W, None)
    if r is None:
        want, _, _ = gc.gsgd_update(chain, None, pb.W, None, G, None, lr=0.1)
    else:
        want, _, _ = gc.path_update(chain, r, state, pb.W, None, G, None)
    split = [[(0, n // 2) for n in chain.sizes[1:]], [(n // 2, n) for n in chain.sizes[1:]]]
    locs = [_rows(pb.W, rows, np.copy) for rows in split]

    def step(rank, reduce):
        rows, W = split[rank], locs[rank]
        shard = RowShard(chain, rows, reduce)
        kernels = gb.kernels_for(W[0])
        if r is None:
            return sharded_gsgd_update_(kernels, shard, None, W, None, _rows(G, rows, np.copy),
                                        None, lr=0.1)
        st_ = gc.RuleState(tuple(tuple(_rows(list(buf), rows, np.copy))
                                 for buf in state.buffers), np.asarray(0, np.int32))
        return sharded_path_update_(kernels, shard, r, st_, W, None, _rows(G, rows, np.copy),
                                    None)

    assert run_processes(2, step) == [True, True]
    for got, w in zip(_join(locs, np.asarray), want):
        assert_close(got, w, 1e-12)


@pytest.mark.parametrize("rule", ["gsgd", "adamw"])
def test_a_state_of_the_whole_layers_is_refused_naming_the_buffer(rule):
    """A step's buffers hold this process's rows, as its weights do (G-SGD's momentum, the
    rule's buffers)."""
    chain = gc.Chain.mlp([4, 6, 5, 3])
    rows = [(2, 4), (0, 3), (1, 3)]
    pb = Problem(chain, 0)
    loc = _bad(chain, rows)
    shard = RowShard(chain, rows, lambda v: pytest.fail("a refused step reduced a vector"))
    kernels = gb.kernels_for(np.zeros(1))
    with pytest.raises(ValueError, match=r"^layer 1: buffers\[0\]\[0\] has shape \(6, 4(, 1)?\), "
                       r"but this process holds its rows \[2, 4\) of 4 entries$"):
        if rule == "gsgd":
            sharded_gsgd_update_(kernels, shard, gc.gsgd_init(chain, pb.W, pb.b),
                                 *loc.values(), lr=0.1, momentum=0.9)
        else:
            sharded_path_update_(kernels, shard, RULES[rule], gc.path_init(
                chain, RULES[rule], pb.W, pb.b), *loc.values())


@pytest.mark.parametrize("lib", [p for p in LIB_PARAMS if p.values[0] in ("torch", "torch-cuda")])
@pytest.mark.parametrize("rule", ["gsgd", "adamw"])
def test_a_weight_that_cannot_be_written_in_place_hands_the_step_back(rule, lib):
    """A local weight that is not contiguous (a transposed view) has no in-place view: its
    special edges are still gathered (from a copy of its rows), and the step is handed
    back with nothing written."""
    to, _ = LIBS[lib]
    chain = gc.Chain.mlp([4, 6, 5, 3])
    rows = [(0, 6), (0, 5), (0, 3)]
    loc = {k: [None if a is None else to(a) for a in v] for k, v in _bad(chain, rows).items()}
    loc["weights"][1] = reverse_axes(reverse_axes(loc["weights"][1]).contiguous())
    before = [w.clone() for w in loc["weights"] + loc["biases"]]
    shard = RowShard(chain, rows, lambda v: v)
    pb = Problem(chain, 0)
    kernels = gb.kernels_for(loc["weights"][0])
    if RULES[rule] is None:
        done = sharded_gsgd_update_(kernels, shard, None, *loc.values(), lr=0.1)
    else:
        state = gc.path_init(chain, RULES[rule], [to(w) for w in pb.W], [to(b) for b in pb.b])
        done = sharded_path_update_(kernels, shard, RULES[rule], state, *loc.values())
    assert done is False
    assert all(torch.equal(a, b) for a, b in zip(loc["weights"] + loc["biases"], before))


def test_without_weight_decay_a_momentum_step_does_not_read_overflowed_path_values():
    """Two layers of weights near 1e160: every path value overflows to inf. torch's SGD adds
    nothing for ``weight_decay = 0``, so the step and its momentum buffers are the core's
    (a decay term ``0 * inf`` is NaN)."""
    chain = gc.Chain.mlp([3, 4, 2])
    rows = [(0, n) for n in chain.sizes[1:]]
    pb = Problem(chain, 0)
    W, b = [w * 1e160 for w in pb.W], [x.copy() for x in pb.b]
    G, Gb = pb.grads()
    hyper = dict(lr=0.1, momentum=0.9, weight_decay=0.0)
    want_W, _, want = gc.gsgd_update(chain, gc.gsgd_init(chain, W, b), W, b, G, Gb, **hyper)
    state = gc.gsgd_init(chain, W, b)
    assert sharded_gsgd_update_(gb.kernels_for(W[0]), RowShard(chain, rows, lambda v: v),
                                state, W, b, G, Gb, **hyper)
    for got, w in zip(W + list(state.momentum), list(want_W) + list(want.momentum)):
        np.testing.assert_allclose(got, w, rtol=1e-12)  # buffers near 1e-160: no atol


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("lib", LIB_PARAMS)
def test_a_process_without_rows_of_a_layer_steps_as_the_core(lib):
    """Process 1 holds no rows of layer 2 and process 0 none of layer 3: their column sums
    there are zeros, made where the step computes (no kernel runs on the empty rows, which
    torch's would resize its scratch for, with a warning)."""
    to, from_ = LIBS[lib]
    chain = gc.Chain.mlp([4, 6, 5, 3])
    pb = Problem(chain, 5)
    G, Gb = pb.grads()
    want, want_b, _ = gc.gsgd_update(chain, None, pb.W, pb.b, G, Gb, lr=0.1)
    split = [[(0, 3), (0, 5), (0, 0)], [(3, 6), (5, 5), (0, 3)]]
    locs = [dict(W=_rows(pb.W, r, to), b=_rows(pb.b, r, to)) for r in split]

    def step(rank, reduce):
        rows, loc = split[rank], locs[rank]
        return sharded_gsgd_update_(_kernels(lib, loc["W"][0]), RowShard(chain, rows, reduce),
                                    None, loc["W"], loc["b"], _rows(G, rows, to),
                                    _rows(Gb, rows, to), lr=0.1)

    assert run_processes(2, step) == [True, True]
    got = _join([p["W"] for p in locs], from_) + _join([p["b"] for p in locs], from_)
    for g, w in zip(got, want + want_b):
        assert_close(g, w, 1e-12)


def test_a_layer_without_a_bias_does_not_end_the_checks_of_the_biases_above():
    chain = gc.Chain.from_shapes([(6, 4), (5, 6), (3, 5)], bias=[False, True, True])
    rows = [(0, 6), (0, 5), (0, 3)]
    loc = _bad(chain, rows, biases=(2, np.zeros(2)))
    with pytest.raises(ValueError, match=r"^layer 3: biases\[2\] has shape \(2,\), but this "
                       r"process holds its rows \[0, 3\)$"):
        _local_step(chain, RowShard(chain, rows, lambda v: v), None, loc)


def test_a_shard_checks_again_when_the_arrays_change_after_a_valid_step():
    chain = gc.Chain.mlp([4, 6, 5, 3])
    rows = [(0, 6), (0, 5), (0, 3)]
    shard = RowShard(chain, rows, lambda v: v)
    assert _local_step(chain, shard, None, _bad(chain, rows))
    with pytest.raises(ValueError, match=r"^layer 2: biases\[1\] has shape \(4,\)"):
        _local_step(chain, shard, None, _bad(chain, rows, biases=(1, np.zeros(4))))
