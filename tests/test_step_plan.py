"""Step plans and the kernel interface (gsgd_backends.plan, gsgd_backends.kernels).

A plan is owned by whoever steps: nothing is cached on the chain by the backends, a plan
that does not fit is refused, the torch optimizers keep one per chain. The torch plan that
GPUs run (every layer on ``ON_DEVICE``: whole layers, per-entry rules) is run here on the
CPU: it equals the core and reads one value back to the host per step."""


import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import gsgd_backends as gb
import gsgd_core as gc
from gsgd_backends import fast, rule_step
from _conditioning import assert_step_close, gsgd_tolerance, synced_gsgd_steps
from _helpers import Problem, assert_close, from_repository, reverse_axes
from _strategies import chains, examples, random_params, seeds

torch = pytest.importorskip("torch")
gbt = pytest.importorskip("gsgd_backends.torch")
HostReads = from_repository("benchmarks.step_counts").HostReads

CHAIN = gc.Chain.from_shapes([(4, 3, 3, 3), (5, 4, 2, 2), (6, 5 * 4), (3, 6)],
                             bias=[True, False, True, True])
HYPERS = [dict(), dict(momentum=0.9), dict(momentum=0.9, nesterov=True, weight_decay=0.01),
          dict(weight_decay=0.1), dict(momentum=0.5, dampening=0.3)]
def _record_calls(monkeypatch, modules, names) -> list:
    """The names of the functions ``names`` of ``modules`` in the order they are called
    (each still runs)."""
    calls = []
    for module in modules:
        for name in names:
            real = getattr(module, name)
            monkeypatch.setattr(module, name,
                                lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    return calls


def _tensors(arrays):
    return [None if a is None else torch.tensor(a) for a in arrays]


def _grads(pb):
    G, Gb = pb.grads()
    return _tensors(G), _tensors(Gb)


@pytest.mark.parametrize("hyper", HYPERS, ids=str)
def test_device_plan_reads_one_value_back_per_step(hyper):
    """The GPU plan's only host read is the vector stage's flags: the bulk takes per-entry
    rules instead of checking each block, momentum included."""
    pb = Problem(CHAIN, 0)
    W, b = _tensors(pb.W), _tensors(pb.b)
    state = gc.gsgd_init(CHAIN, W, b) if hyper.get("momentum") else None
    plan = gbt.ON_DEVICE.plan(CHAIN, W[0])
    assert all(k is gbt.ON_DEVICE for k in plan.layer_kernels)
    G, Gb = _grads(pb)
    for _ in range(2):  # the first step of a momentum buffer, then one with history
        with HostReads() as reads:
            assert fast.fast_step_(None, CHAIN, W, b, G, Gb, 0.1, state, plan=plan, **hyper)
        assert sum(reads.count.values()) == 1, reads.count
        if state is not None:
            gb.inplace.assign(state.step, state.step + 1)


def test_device_plan_rule_step_reads_one_value_back():
    pb = Problem(CHAIN, 1)
    W, b = _tensors(pb.W), _tensors(pb.b)
    rule = gc.adamw_rule(0.01, amsgrad=True)
    state = gc.path_init(CHAIN, rule, W, b)
    G, Gb = _grads(pb)
    plan = gbt.ON_DEVICE.plan(CHAIN, W[0])
    with HostReads() as reads:
        assert rule_step.rule_step_(None, CHAIN, rule, state, W, b, G, Gb, plan=plan)
    assert sum(reads.count.values()) == 1, reads.count


@settings(max_examples=examples(25), deadline=None)
@given(chain=chains(), seed=seeds, hyper=st.sampled_from(HYPERS),
       dtype=st.sampled_from(["float64", "float32"]))
def test_device_plan_equals_the_core(chain, seed, hyper, dtype):
    """Two steps of the GPU plan (on the CPU) against gsgd_update, each from the core's
    state: path values, momentum buffers, and the weights and biases where no tau ratio
    nears 0 (:mod:`_conditioning`), on drawn chains (custom skeletons, slots, biases)."""
    from _namespaces import _torch
    synced_gsgd_steps(_torch(dtype), chain, Problem(chain, seed), hyper, 2, lr=0.1,
                      rtol=1e-12 if dtype == "float64" else 2e-4,
                      plan=lambda w: gbt.ON_DEVICE.plan(chain, w))


def _core_keys(chain):
    """The keys the core caches on a chain (layer metadata per namespace and device)."""
    return {k for k in chain._cache if isinstance(k, tuple) and len(k) == 2
            and all(isinstance(x, str) for x in k)}


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_backends_cache_nothing_on_the_chain(lib):
    """G-SGD with momentum and G-AdamW through the in-place layer: the chain's cache holds
    the core's layer metadata and nothing of the backends."""
    chain = gc.Chain.from_shapes([(4, 3, 3, 3), (5, 4, 2, 2), (6, 5 * 4), (3, 6)],
                                 bias=[True, False, True, True])
    pb = Problem(chain, 2)
    conv = _tensors if lib == "torch" else (lambda a: [None if x is None else x.copy()
                                                       for x in a])
    W, b = conv(pb.W), conv(pb.b)
    G, Gb = (conv(x) for x in pb.grads())
    state = gc.gsgd_init(chain, W, b)
    plan = gb.step_plan(chain, W)
    for _ in range(2):
        assert gb.gsgd_update_(chain, state, W, b, G, Gb, lr=0.1, momentum=0.9, plan=plan)
    rule = gc.adamw_rule(0.01)
    assert gb.path_update_(chain, rule, gc.path_init(chain, rule, W, b), W, b, G, Gb)
    assert set(chain._cache) == _core_keys(chain), set(chain._cache)


def test_a_plan_that_does_not_fit_is_refused():
    pb = Problem(CHAIN, 3)
    W, b = _tensors(pb.W), _tensors(pb.b)
    G, Gb = _grads(pb)
    plan = gb.step_plan(CHAIN, [w.float() for w in W])
    with pytest.raises(ValueError, match="does not fit"):
        gb.gsgd_update_(CHAIN, None, W, b, G, Gb, lr=0.1, plan=plan)
    other = gc.Chain.mlp([4, 4, 2])
    with pytest.raises(ValueError, match="does not fit"):
        gb.gsgd_update_(CHAIN, None, W, b, G, Gb, lr=0.1, plan=gb.step_plan(other, W))
    assert all(torch.equal(w, torch.tensor(a)) for w, a in zip(W, pb.W))  # nothing written


def test_a_plan_fits_an_equal_chain_and_its_own_device_and_dtype_only():
    """``fits`` compares chains by value, the array's dtype, and its device (an array
    without a ``device``, as NumPy's before 2.0, is on the CPU)."""
    W = _tensors(Problem(CHAIN, 3).W)
    plan = gb.step_plan(CHAIN, W)
    twin = gc.Chain.from_shapes([(4, 3, 3, 3), (5, 4, 2, 2), (6, 5 * 4), (3, 6)],
                               bias=[True, False, True, True])
    assert twin is not CHAIN and plan.fits(twin, W[0])
    assert not plan.fits(CHAIN, W[0].float())
    assert not plan.fits(CHAIN, W[0].to("meta"))
    no_device = type("Old", (), {"dtype": W[0].dtype})()
    assert plan.fits(CHAIN, no_device)
    assert type(plan.kernels).__name__ in repr(plan) and "device=cpu" in repr(plan)


def test_kernel_sets_declare_the_interface():
    import gsgd_backends.numpy as gbn

    for k in (gbn.KERNELS, gbt.KERNELS, gbt.COMPILED, gbt.ON_DEVICE):
        assert isinstance(k, gb.Kernels), k
    for k in (gbn.KERNELS, gbt.KERNELS, gbt.ON_DEVICE):  # the eager ones run block loops
        assert isinstance(k, gb.BlockKernels), k
    assert isinstance(gbt.ON_NUMPY, gb.LayerKernels)


@pytest.mark.parametrize("name, given, host, checked", [
    ("KERNELS", {}, True, True),
    ("COMPILED", {"compiled": True}, False, False),
    ("ON_DEVICE", {"host": False, "checked": False}, False, False),
])
def test_torch_kernel_sets_are_what_their_arguments_make(name, given, host, checked):
    """Eager kernels compute on NumPy views (``host``) and check each bulk block by a host
    read (``checked``) unless told not to; compiled ones do neither, whatever they are
    told, and take compat's namespace. The module's kernel sets are these constructions."""
    import array_api_compat.torch as compat

    made = gbt.TorchKernels(gbt.CHUNK, **given)
    compiled = given.get("compiled", False)
    assert (made.host, made.checked, made.traced) == (host, checked, compiled)
    assert made.xp is (compat if compiled else gbt.NAMESPACE)
    assert (made.chunk, made.small) == (gbt.CHUNK, gbt.SMALL)
    assert vars(made) == vars(getattr(gbt, name))
    told = gbt.TorchKernels(gbt.CHUNK, compiled=compiled, host=True, checked=True)
    assert (told.host, told.checked) == (not compiled, not compiled)
    assert gbt.TorchOnNumPy(made).kernels is made
    assert gbt.ON_NUMPY.kernels is gbt.KERNELS


def test_torch_blocks_fit_the_chunk_when_checked_and_are_whole_layers_otherwise():
    """Like NumPy's kernels, checked eager kernels update a CPU layer in blocks of
    ``chunk // (p k)`` rows, at least one; unchecked or compiled ones, and any layer off
    the CPU, in one block."""
    W = torch.zeros(10, 3, 4)
    assert gbt.TorchKernels(24).block_rows(W) == 2
    assert gbt.TorchKernels(35).block_rows(W) == 2
    assert gbt.TorchKernels(5).block_rows(W) == 1
    assert gbt.TorchKernels(10 ** 6).block_rows(W) == 10
    assert gbt.TorchKernels(24).block_rows(torch.zeros(10, 3, 4, device="meta")) == 10
    for whole in (gbt.TorchKernels(24, checked=False), gbt.TorchKernels(24, compiled=True)):
        assert whole.block_rows(W) == 10


def test_each_compiled_stage_is_a_copy_of_the_function_with_its_defaults_and_closure(
        monkeypatch):
    """``compile`` hands ``torch.compile`` a new function object (dynamo's cache and
    recompilation limit are per code object and function), which keeps the original's name,
    positional and keyword-only defaults and closure, compiled specialised to its shapes
    (``dynamic=False``), its short loops on one thread; eager kernels return the function
    itself."""
    k = 3

    def stage(x, y=2, *, z=5):
        return x * y + z + k

    seen = {}
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.update(fn=fn, **kw) or "done")
    assert gbt.COMPILED.compile(stage) == "done"
    copy = seen.pop("fn")
    assert seen == {"dynamic": False, "options": {"cpp.min_chunk_size": gbt.SERIAL}}
    assert copy is not stage and copy.__code__ == stage.__code__
    assert (copy.__name__, copy.__defaults__, copy.__kwdefaults__) == ("stage", (2,), {"z": 5})
    assert copy(1) == stage(1) == 10 and copy(1, 3, z=0) == 6
    assert gbt.KERNELS.compile(stage) is stage


def test_compiled_stages_take_scalars_as_tensors_and_eager_ones_as_floats():
    """A compiled stage gets a 0-d tensor of the step's dtype on its device (a new Python
    float would compile anew: a learning-rate schedule); eager kernels keep the float."""
    for device in ("cpu", "meta"):
        lr = gbt.COMPILED.scalar(0.25, torch.float32, torch.device(device))
        assert (lr.shape, lr.dtype, lr.device.type) == ((), torch.float32, device)
    assert gbt.COMPILED.scalar(0.25, torch.float64, "cpu").item() == 0.25
    for eager in (gbt.KERNELS, gbt.ON_DEVICE):
        assert type(eager.scalar(0.25, torch.float32, "cpu")) is float


@pytest.mark.parametrize("kernels", ["COMPILED", "ON_DEVICE"])
def test_unchecked_bulk_divides_per_entry_only_without_reciprocals(monkeypatch, kernels):
    """The unchecked plain bulk (compiled, or a GPU's) multiplies by the node vectors'
    reciprocals when the step gives them (a compiled step does for a tame layer: no
    division per entry) and takes the core's per-entry rules when it does not; either way
    a ``(n, p*k)`` layer is written in place with the core's values, here ``k = 2``."""
    import array_api_compat.torch as compat

    calls = _record_calls(monkeypatch, [gbt], ("recip_rows", "exact_rows"))
    rng = np.random.default_rng(5)
    F, B, rho = (torch.tensor(rng.uniform(0.5, 2.0, n)) for n in (4, 3, 3))
    W0, G = (torch.tensor(rng.standard_normal((4, 6))) for _ in range(2))
    want = fast.exact_rows(compat, W0.view(4, 3, 2), G.view(4, 3, 2), F=F, B_prev=B, rho=rho,
                           lr=0.1).view(4, 6)
    for recips, used in ((fast.reciprocals(compat, F, B, rho, 2), "recip_rows"),
                         (None, "exact_rows")):
        calls.clear()
        W = W0.clone()
        getattr(gbt, kernels).bulk_(W, G, F=F, B=B, rho=rho, lr=0.1, recips=recips)
        assert calls == [used]
        assert_close(W.numpy(), want.numpy(), 1e-14)


def test_numpy_arrays_reach_torch_kernels_sharing_memory_unless_read_only():
    """A large layer of a CPU plan hands its NumPy views to torch's kernels as tensors on
    the same memory, so that they write the weights in place; a read-only array (a node
    vector) is copied, since torch has no read-only tensors. Scalars become 0-d tensors,
    nested tuples and lists (and named tuples) keep their types, other leaves stay."""
    from collections import namedtuple

    w = np.arange(6.0).reshape(2, 3)
    ro = w.copy()
    ro.flags.writeable = False
    Pair = namedtuple("Pair", "a b")
    t, (r, s), pair, none = gbt._tensors((w, [ro, np.float32(2.5)], Pair(w, 1.5), None))
    assert np.shares_memory(t.numpy(), w)
    assert not np.shares_memory(r.numpy(), ro) and torch.equal(r, torch.from_numpy(w))
    assert s.shape == () and s.dtype == torch.float32 and float(s) == 2.5
    assert type(pair) is Pair and np.shares_memory(pair.a.numpy(), w) and pair.b == 1.5
    assert none is None


def test_layer_kernels_take_the_declared_keywords():
    """The steps pass a layer's node vectors, learning rate and buffers by keyword, so every
    set of layer kernels names its parameters as :class:`LayerKernels` declares them, down to
    which are keyword-only (a kernel set that a step rarely reaches, CuPy's on a GPU, is
    checked here rather than on the step that would reach it)."""
    import inspect

    import gsgd_backends.numpy as gbn

    def shape(f):
        return [(p.name, p.kind) for p in inspect.signature(f).parameters.values()
                if p.name != "self"]

    for name in ("bulk_", "rows_bulk_", "rule_bulk_"):
        declared = shape(getattr(gb.LayerKernels, name))
        assert sum(kind == inspect.Parameter.KEYWORD_ONLY for _, kind in declared) >= 3, name
        for k in (gbn.KERNELS, gbt.KERNELS, gbt.COMPILED, gbt.ON_DEVICE, gbt.ON_NUMPY):
            assert shape(getattr(k, name)) == declared, (type(k).__name__, name)


def test_a_namespace_is_its_base_public_names_and_name_with_the_replacements():
    import types

    from gsgd_backends.kernels import namespace

    base = types.ModuleType("lib")
    base.add, base.take, base._private = max, min, len
    xp = namespace(base, take=sorted)
    assert xp.__name__ == "lib" and xp.add is max and xp.take is sorted
    assert not hasattr(xp, "_private")


def test_eager_namespaces_are_copies_with_cheaper_takes_and_reshapes():
    """The eager kernels' namespaces are their libraries' compat namespaces, copied (a
    lookup is no Python call, unlike a proxy's ``__getattr__``), hashable as themselves,
    with a ``take`` that gathers as compat's does on the step's vectors."""
    import array_api_compat.numpy as np_compat
    import array_api_compat.torch as torch_compat

    import gsgd_backends.numpy as gbn
    from gsgd_backends.kernels import namespace

    for kernels, base, x in ((gbn.KERNELS, np_compat, np.arange(5.0)),
                             (gbt.KERNELS, torch_compat, torch.arange(5.0))):
        xp = kernels.xp
        assert xp.__name__ == base.__name__ and xp.where is base.where
        assert xp.take is not base.take, "the eager kernels take through compat's wrapper"
        assert not hasattr(type(xp), "__getattr__")
        assert xp == xp and xp != namespace(base) and {xp: 1}[xp] == 1
        index = base.asarray([3, 0, 3])
        assert base.all(xp.take(x, index) == base.take(x, index))
    # NumPy's reshape is the method too: a view with compat's shape and values
    xp, a = gbn.KERNELS.xp, np.arange(12.0).reshape(3, 4)
    assert xp.reshape is not np_compat.reshape, "the NumPy kernels reshape through a wrapper"
    for shape in [(-1,), (4, -1), (2, 3, 2)]:
        r = xp.reshape(a, shape)
        assert np.shares_memory(r, a) and np.array_equal(r, np_compat.reshape(a, shape))


def test_cpu_plans_pick_each_layers_kernels_once():
    """Eager CPU tensors: the step computes on NumPy views; small layers take NumPy's
    kernels and a layer above ``small`` weights torch's (on the same memory)."""
    import gsgd_backends.numpy as gbn

    chain = gc.Chain.mlp([300, 500, 8])  # 150,000 and 4,000 weights
    W = [torch.zeros(500, 300), torch.zeros(8, 500)]
    plan = gbt.KERNELS.plan(chain, W[0])
    assert plan.kernels is gbn.KERNELS and plan.view is not None
    assert plan.layer_kernels == (gbt.ON_NUMPY, gbn.KERNELS)
    compiled = gbt.COMPILED.plan(chain, W[0])
    assert compiled.view is None and set(compiled.layer_kernels) == {gbt.COMPILED}
    for inputs, large in ((256, gbn.KERNELS), (257, gbt.ON_NUMPY)):  # 512 * 256 = SMALL
        edge = gc.Chain.mlp([inputs, 512, 2])
        plan = gbt.KERNELS.plan(edge, torch.zeros(512, inputs))
        assert plan.layer_kernels == (large, gbn.KERNELS), inputs


def test_torch_plans_off_the_cpu_or_off_its_dtypes_take_torchs_kernels():
    """Off the CPU (a ``meta`` tensor stands for a GPU's), eager kernels plan every layer on
    ``ON_DEVICE`` (no host read in the bulk); compiled ones keep themselves. A CPU dtype
    NumPy's kernels do not take (float16) stays with torch's eager kernels, checked."""
    chain = gc.Chain.mlp([3, 4, 2])
    meta = torch.empty(4, 3, device="meta")
    for kernels, own in ((gbt.KERNELS, gbt.ON_DEVICE), (gbt.ON_DEVICE, gbt.ON_DEVICE),
                         (gbt.COMPILED, gbt.COMPILED)):
        plan = kernels.plan(chain, meta)
        assert plan.kernels is own and set(plan.layer_kernels) == {own}
        assert plan.view is None and plan.device == meta.device
    half = gbt.KERNELS.plan(chain, torch.zeros(4, 3, dtype=torch.float16))
    assert half.kernels is gbt.KERNELS and set(half.layer_kernels) == {gbt.KERNELS}


def test_torch_scratch_buffers_are_made_on_the_layers_device():
    for device in ("cpu", "meta"):
        like = torch.empty(3, dtype=torch.float32, device=device)
        buf = gbt.KERNELS.scratch(gb.plan.Scratch(), like, 5)
        assert (buf.shape, buf.dtype, buf.device) == ((5,), torch.float32, like.device)


def test_a_device_plan_takes_its_column_sums_in_one_scratch_buffer_kept_across_steps():
    """The GPU plan's column sums form their products in the plan's scratch buffer (its
    bulk needs none): made on the first step, the size of the largest layer summed, and
    the same buffer on every later step, so no step allocates a layer-sized block."""
    pb = Problem(CHAIN, 0)
    W, b = _tensors(pb.W), _tensors(pb.b)
    plan = gbt.ON_DEVICE.plan(CHAIN, W[0])
    kept = []
    for step in range(2):
        G, Gb = Problem(CHAIN, 10 + step).grads()
        assert fast.fast_step_(None, CHAIN, W, b, _tensors(G), _tensors(Gb), 0.1, plan=plan)
        kept.append(dict(plan.scratch.buffers))
    (key, buf), = kept[0].items()
    largest = max(int(np.prod(CHAIN.layer_shape(l))) for l in range(2, CHAIN.L + 1))
    assert key == (torch.Tensor, W[0].dtype, "cpu") and buf.shape == (largest,)
    assert list(kept[1]) == [key] and kept[1][key] is buf


def test_the_realized_operator_copies_a_tensor_of_any_dtype():
    """``gsgd::realized``, through which a compiled step stores its node vectors, returns
    a tensor of its own equal to its argument whatever its dtype: NumPy, which takes the
    float32 and float64 copies, has no bfloat16."""
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
        x = torch.arange(6, dtype=dtype).view(2, 3)
        y = gbt.realized(x)
        assert y.dtype == dtype and torch.equal(y, x) and y.data_ptr() != x.data_ptr()


def test_torch_layer_views_share_storage_and_copy_only_what_is_read():
    """``view3`` gives a ``(n, p, k)`` view on a contiguous tensor's storage; a
    non-contiguous one cannot be written through a view (``None``: the step is handed
    back) but can be read from a reshaped copy (a transposed gradient)."""
    w = torch.arange(24.0).reshape(4, 6)
    v = gbt.KERNELS.view3(w, (4, 3, 2))
    assert v.shape == (4, 3, 2) and v.data_ptr() == w.data_ptr()
    t = w.t()
    assert gbt.KERNELS.view3(t, (6, 2, 2)) is None
    read = gbt.KERNELS.view3(t, (6, 2, 2), writable=False)
    assert read.shape == (6, 2, 2) and torch.equal(read, t.reshape(6, 2, 2))


def test_optimizer_keeps_one_plan_per_chain_and_rebuilds_it_after_a_dtype_change():
    from gsgd_adapters.torch import GSGD, skeleton_init_

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    skeleton_init_(model)
    opt = GSGD(model, lr=0.05, momentum=0.9)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(model[0].weight.dtype)), y).backward()
        opt.step()

    step()
    (plan,) = opt._steppers.values()
    step()
    assert list(opt._steppers.values()) == [plan]  # reused
    model.double()
    for group in opt.param_groups:
        for p in group["params"]:
            if "momentum_buffer" in opt.state[p]:
                opt.state[p]["momentum_buffer"] = opt.state[p]["momentum_buffer"].double()
    step()
    (new,) = opt._steppers.values()
    assert new is not plan and new.dtype == torch.float64
    assert all(np.isfinite(p.detach().numpy()).all() for p in model.parameters())


def test_device_plan_hands_back_a_weight_it_cannot_write_in_place():
    """A non-contiguous weight cannot be written through a view: the device plan hands the
    step back before writing anything, and the in-place layer then takes the core's step."""
    pb = Problem(CHAIN, 4)
    W, b = _tensors(pb.W), _tensors(pb.b)
    W[2] = reverse_axes(reverse_axes(W[2]).contiguous())  # same values, reversed strides
    assert not W[2].is_contiguous()
    G, Gb = _grads(pb)
    plan = gbt.ON_DEVICE.plan(CHAIN, W[0])
    before = [w.clone() for w in W]
    assert not fast.fast_step_(None, CHAIN, W, b, G, Gb, 0.1, plan=plan)
    assert all(torch.equal(w, x) for w, x in zip(W, before))
    assert gb.gsgd_update_(CHAIN, None, W, b, G, Gb, lr=0.1, plan=plan)
    want, _ = gc.gsgd_step(CHAIN, before, _tensors(pb.b), G, Gb, 0.1)
    for got, w in zip(W, want):
        assert_close(got.numpy(), w.numpy(), 1e-12)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_cpu_plan_updates_finite_blocks_in_place(monkeypatch, momentum):
    """On the CPU a large layer's blocks are computed in cache and checked there: a finite
    step never builds the per-entry rules' temporaries (the GPU plan always does)."""
    # the eager blocks' fallback lives in fast, the GPU's in gbt
    calls = _record_calls(monkeypatch, [gbt, fast], ("exact_rows", "rows_by_rules"))
    chain = gc.Chain.mlp([300, 500, 8], bias=False)  # 150,000 weights: ON_NUMPY
    rng = np.random.default_rng(0)
    W = [torch.tensor(rng.uniform(0.5, 1.5, s)) for s in [(500, 300), (8, 500)]]
    G = [torch.tensor(rng.standard_normal(w.shape) * 1e-3) for w in W]
    state = gc.gsgd_init(chain, W, None)
    plan = gbt.KERNELS.plan(chain, W[0])
    assert plan.layer_kernels[0] is gbt.ON_NUMPY
    assert gb.gsgd_update_(chain, state, W, None, G, None, lr=0.1, momentum=momentum,
                           plan=plan)
    assert calls == []
    device = gbt.ON_DEVICE.plan(chain, W[0])
    assert gb.gsgd_update_(chain, state, W, None, G, None, lr=0.1, momentum=momentum,
                           plan=device)
    assert calls  # the unchecked kernels take the rules


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_cpu_plan_checks_a_large_first_layer_on_torch(bad):
    """Layer 1's gradients are in no backward sum: a large first layer (ON_NUMPY) is checked
    by its own kernels' sum, and a NaN or Inf there hands the step back unwritten."""
    chain = gc.Chain.mlp([300, 500, 8], bias=False)  # 150,000 weights: ON_NUMPY
    rng = np.random.default_rng(1)
    W = [torch.tensor(rng.uniform(0.5, 1.5, s)) for s in [(500, 300), (8, 500)]]
    G = [torch.tensor(rng.standard_normal(w.shape) * 1e-3) for w in W]
    G[0][7, 11] = bad
    plan = gbt.KERNELS.plan(chain, W[0])
    assert plan.layer_kernels[0] is gbt.ON_NUMPY
    before = [w.clone() for w in W]
    assert not fast.fast_step_(gbt.KERNELS, chain, W, None, G, None, 0.1, plan=plan)
    assert all(torch.equal(w, x) for w, x in zip(W, before))


def _factor_calls(monkeypatch, chain, seed, wrap, kernels=None) -> int:
    """``recip_square`` calls of one plain fast step of ``chain`` on arrays made by ``wrap``
    (through ``kernels``' own plan if given), after checking that the step equals the
    core's."""
    calls = []
    real = fast.recip_square
    monkeypatch.setattr(fast, "recip_square", lambda *a: calls.append(1) or real(*a))
    pb = Problem(chain, seed)
    G, Gb = pb.grads()
    W, b = [wrap(w) for w in pb.W], [wrap(x) for x in pb.b]
    kernels = kernels or gb.kernels_for(W[0])
    assert fast.fast_step_(kernels, chain, W, b, [wrap(g) for g in G], [wrap(g) for g in Gb],
                           0.1, plan=kernels.plan(chain, W[0]))
    eW, eb = gc.gsgd_step(chain, pb.W, pb.b, G, Gb, 0.1)
    for got, want in zip(W + b, eW + eb):
        assert_close(np.asarray(got), want, 1e-12)
    return len(calls)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_eager_plain_step_forms_its_bulk_factors_once(monkeypatch, lib):
    """The eager bulk's ``1/F**2`` and ``-lr/B**2`` come from the vector stage, formed once
    on the stacked node vectors (two ``recip_square`` calls a step), not layer by layer:
    small layers and large ones (torch's ``ON_NUMPY``) alike, and the step equals the
    core."""
    chain = gc.Chain.mlp([300, 500, 8, 6], bias=True)  # 150,000 weights: ON_NUMPY on torch
    calls = _factor_calls(monkeypatch, chain, 2, torch.tensor if lib == "torch" else np.copy)
    assert calls == 2, f"recip_square ran {calls} times for {chain.L} layers"


def test_device_plan_forms_no_block_loop_factors(monkeypatch):
    """The plan GPUs take (``ON_DEVICE``, run here on the CPU) applies the per-entry rules to
    whole layers: its vector stage forms no factors for the block loops it never runs."""
    chain = gc.Chain.mlp([6, 5, 4], bias=True)
    assert not _factor_calls(monkeypatch, chain, 3, torch.tensor, gbt.ON_DEVICE)


@pytest.mark.parametrize("widths", [[3, 1, 2], [4, 3, 1], [2, 1, 1, 3]], ids=str)
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_layers_of_one_unit_step_like_the_core(lib, widths):
    """Layers with a single output unit (one row: every one of its edges special)."""
    chain = gc.Chain.mlp(widths)
    pb = Problem(chain, 5)
    conv = _tensors if lib == "torch" else (lambda a: [None if x is None else x.copy()
                                                       for x in a])
    W, b = conv(pb.W), conv(pb.b)
    G, Gb = (conv(x) for x in pb.grads())
    for hyper in (dict(), dict(momentum=0.9, nesterov=True)):
        state = gc.gsgd_init(chain, W, b)
        Wc, bc, core = gc.gsgd_update(chain, gc.gsgd_init(chain, W, b), W, b, G, Gb, lr=0.1,
                                      **hyper)
        Wf, bf = [w * 1 for w in W], [x * 1 for x in b]
        assert fast.fast_step_(gb.kernels_for(W[0]), chain, Wf, bf, G, Gb, 0.1, state,
                               **hyper)
        for got, want in zip(Wf + bf, Wc + bc):
            assert_close(np.asarray(got), np.asarray(want), 1e-12)


def test_rule_step_hands_back_buffers_of_another_dtype():
    """float32 moments beside float64 weights cannot be updated by the fast kernels: the
    step is handed back with nothing written (the core then computes it)."""
    pb = Problem(CHAIN, 6)
    W, b = _tensors(pb.W), _tensors(pb.b)
    G, Gb = _grads(pb)
    rule = gc.adam_rule(0.01)
    state = gc.path_init(CHAIN, rule, [w.float() for w in W],
                         [None if x is None else x.float() for x in b])
    before = [w.clone() for w in W]
    assert not rule_step.rule_step_(gb.kernels_for(W[0]), CHAIN, rule, state, W, b, G, Gb)
    assert all(torch.equal(w, x) for w, x in zip(W, before))


def _traced_eagerly():
    """The compiled kernels' code path run without the compiler (``compile`` returns the
    function itself): the tame test, the reciprocals and ``recip_rows`` in seconds."""
    kernels = gbt.TorchKernels(gbt.CHUNK, compiled=True)
    kernels.compile = lambda fn: fn
    return kernels


@settings(max_examples=examples(25), deadline=None)
@given(chain=chains(), seed=seeds, lr=st.sampled_from([0.01, 0.5]),
       scale=st.sampled_from([1.0, 1e-20, 1e20, 1e160]),
       dtype=st.sampled_from(["float64", "float32"]))
# Found by the thorough profile: a tau path ratio of 1.7e-15 (a cancelling 1 - lr D / V)
# divides the weights above it by pure rounding; the two sides then differ by 1e43 there.
@example(chain=gc.Chain(sizes=(6, 2, 5, 2, 4, 1), slots=(8, 1, 4, 9, 2),
                        bias=(True, False, True, True, False),
                        tau=((0, 0), (0, 0, 0, 0, 0), (0, 0), (0, 0, 0, 0)),
                        sigma=((0, 0), (0, 0, 1, 0, 0), (0, 0), (0, 0, 0, 0)),
                        skeleton_slots=(0, 0, 0, 0, 0), skeleton_scale=(1.0,) * 5),
         seed=1_523_363_476, lr=0.01, scale=1e-20, dtype="float64")
@example(chain=gc.Chain.mlp([1] * 5, bias=False), seed=0, lr=0.01, scale=1e160,
         dtype="float64")
def test_traced_plan_run_eagerly_equals_the_core(chain, seed, lr, scale, dtype):
    """The traced (compiled) plan's arithmetic: tame layers by reciprocals, the others by
    the per-entry rules (``scale`` on the first and last layers moves ``B`` and ``F`` out
    of the tame range, where ``F B`` over- or underflows). Compared in path space within
    the step's rounding, and weight by weight where the step is well conditioned
    (``_conditioning.assert_step_close``)."""
    pb = Problem(chain, seed)
    dt = getattr(torch, dtype)
    last = len(pb.W) - 1
    W = [torch.tensor(a * (scale if i in (0, last) else 1.0), dtype=dt)
         for i, a in enumerate(pb.W)]
    b = [None if a is None else torch.tensor(a, dtype=dt) for a in pb.b]
    G, Gb = pb.grads([w.double().numpy() for w in W], [None if x is None else x.double().numpy()
                                                      for x in b])
    G = [torch.tensor(g, dtype=dt) for g in G]
    Gb = [None if g is None else torch.tensor(g, dtype=dt) for g in Gb]
    # On the host in float64, where float32's path values cannot overflow; G-SGD's step is
    # linear in D, so its rounding tolerance scales with the dtype's unit roundoff.
    host = lambda xs: [None if x is None else x.double().numpy() for x in xs]
    old, grads = (host(W), host(b)), (host(G), host(Gb))
    want = tuple(host(x) for x in gc.gsgd_step(chain, W, b, G, Gb, lr))
    plan = _traced_eagerly().plan(chain, W[0])
    if not gb.gsgd_update_(chain, None, W, b, G, Gb, lr=lr, plan=plan):
        return  # a non-finite gradient at these scales: skipped like the core
    rtol = 1e-12 if dtype == "float64" else 2e-4
    with np.errstate(over="ignore", invalid="ignore"):
        in_range = all(np.all(np.isfinite(v)) for v in gc.path_values(chain, *old)[0])
    if not in_range:  # path values beyond float64's range: the weights as written
        for got, w in zip(host(W) + host(b), want[0] + want[1]):
            assert_close(got, w, rtol)
        return
    tol, _ = gsgd_tolerance(chain, {}, lr, 0, *old, *grads, gc.gsgd_init(chain, *old))
    units = torch.finfo(dt).eps / torch.finfo(torch.float64).eps
    assert_step_close(chain, old, (host(W), host(b)), want, rtol, [t * units for t in tol])


def _sums(chain, dtype=np.float64):
    return [np.ones(chain.sizes[l - 1], dtype=dtype) for l in range(2, chain.L + 1)]


@pytest.mark.parametrize("bad, message", [
    (lambda s, t: (None, t), "^gradient_check is the check of column_sums: pass both$"),
    (lambda s, t: (s[:-1], t), "column_sums: a chain of 4 layers takes 3 vectors "
                               r"\(layers 2..4\), got 2"),
    (lambda s, t: (s + s[:1], t), "takes 3 vectors .* got 4"),
    (lambda s, t: ([s[0], s[1][:-1], s[2]], t), r"column_sums of layer 3: expected shape "
                                                r"\(5,\) and dtype float64, got \(4,\) "
                                                "and float64"),
    (lambda s, t: ([s[0].reshape(1, -1), s[1], s[2]], t), r"layer 2: .* got \(1, 4\)"),
    (lambda s, t: ([s[0], s[1], s[2].astype(np.float32)], t),
     r"column_sums of layer 4: expected shape \(6,\) and dtype float64, got \(6,\) and "
     "float32"),
    (lambda s, t: (s, t.reshape(1)), r"gradient_check: expected a 0-d array of dtype "
                                     r"float64, got shape \(1,\) and dtype float64"),
    (lambda s, t: (s, t.astype(np.float32)), "gradient_check: .* got shape \\(\\) and "
                                             "dtype float32"),
])
def test_given_column_sums_are_checked_layer_by_layer(bad, message):
    """What a caller hands a step as column sums: one vector per layer 2..L with one entry
    per input unit of the step's dtype, and a 0-d check of that dtype; anything else is a
    ``ValueError`` naming the layer, the expected and the given shape and dtype."""
    sums, check = bad(_sums(CHAIN), np.zeros((), dtype=np.float64))
    with pytest.raises(ValueError, match=message):
        gb.plan.check_column_sums(CHAIN, sums, np.dtype(np.float64), check)


@pytest.mark.parametrize("check", [None, np.zeros((), dtype=np.float32)])
def test_well_formed_column_sums_pass_the_check(check):
    """Sums of the right shapes and dtype pass, with or without their check."""
    assert gb.plan.check_column_sums(CHAIN, _sums(CHAIN, np.float32), np.dtype(np.float32),
                                       check) is None


def _given_sums_step(**given):
    """A fast NumPy step of ``CHAIN`` with ``given`` column sums and check: whether it went
    through, and the weights and biases after it (``None`` stays)."""
    import gsgd_backends.numpy as gbn

    pb = Problem(CHAIN, 3)
    G, Gb = pb.grads()
    W, b = [w.copy() for w in pb.W], [None if x is None else x.copy() for x in pb.b]
    sums = [(w * g).reshape(CHAIN.layer_shape(l)).sum(axis=(0, 2))
            for l, w, g in zip(range(2, CHAIN.L + 1), W[1:], G[1:])]
    given = {k: v(sums, sum(g.sum() for g in G)) for k, v in given.items()}
    done = fast.fast_step_(gbn.KERNELS, CHAIN, W, b, G, Gb, 0.1, **given)
    return done, [a for a in W + b if a is not None], pb


def test_a_step_reads_the_column_sums_it_is_given_and_sums_the_gradients_to_check_them():
    """Column sums handed in without a check (DESIGN §12): the step equals the one that sums
    ``W * grad`` itself, its check the gradients' sum; planted wrong, the sums move the
    weights elsewhere (the step reads them, not the weights)."""
    done, want, _ = _given_sums_step()
    assert done
    done, got, _ = _given_sums_step(column_sums=lambda s, t: s)
    assert done
    for a, e in zip(got, want):
        np.testing.assert_allclose(a, e, rtol=1e-13, atol=1e-15)
    done, wrong, _ = _given_sums_step(column_sums=lambda s, t: [x + 1.0 for x in s])
    assert done and not all(np.allclose(a, e) for a, e in zip(wrong, want))


def test_a_gradient_check_that_is_not_finite_hands_the_step_back_unwritten():
    """The caller's check stands for the gradients: not finite, the fast step hands the
    step back with nothing written (the gradients themselves are all finite here)."""
    done, after, pb = _given_sums_step(column_sums=lambda s, t: s,
                                       gradient_check=lambda s, t: t * np.nan)
    assert not done
    assert all(np.array_equal(a, e) for a, e in zip(after, pb.W + [x for x in pb.b
                                                                   if x is not None]))
    assert _given_sums_step(column_sums=lambda s, t: s, gradient_check=lambda s, t: t)[0]


class _OtherLibrary:
    """Another library's array of NumPy's dtype on NumPy's device (as CuPy's have)."""

    dtype, device = np.dtype(np.float64), "cpu"


class _Deviceless:
    """An array-like with a NumPy dtype and no ``device``."""

    dtype = np.dtype(np.float64)


def test_scratch_buffers_are_reused_per_library_dtype_and_device():
    """``Scratch.get`` hands back one buffer per (array type, dtype, device) for every size
    it holds, and a larger one only when asked for more; arrays of another type, dtype or
    device (or of none) never share one."""
    scratch = gb.plan.Scratch()
    made = []

    def empty(n):
        made.append(n)
        return np.empty(n)

    like = np.zeros(1)
    first = scratch.get(like, 8, empty)
    assert scratch.get(like, 8, empty) is first and scratch.get(like, 3, empty) is first
    assert made == [8]
    larger = scratch.get(like, 9, empty)
    assert larger is not first and made == [8, 9] and scratch.get(like, 9, empty) is larger
    others = [np.zeros(1, dtype=np.float32), _OtherLibrary(), _Deviceless(),
              torch.zeros(1, dtype=torch.float64),
              torch.zeros(1, dtype=torch.float64, device="meta")]
    bufs = [scratch.get(o, 4, empty) for o in others]
    assert len({id(b) for b in [larger] + bufs}) == 6 and made == [8, 9, 4, 4, 4, 4, 4]
    assert all(scratch.get(o, 4, empty) is b for o, b in zip(others, bufs)) and len(made) == 7


def test_a_plan_validates_each_signature_of_arrays_once(monkeypatch):
    """``StepPlan.prepared`` validates a call's arrays as the core does, once per signature
    (types, shapes, dtypes, devices): a training loop's steps after the first validate
    nothing, and missing gradients are refused by name every time, without the plan
    forgetting the signature it validated."""
    chain = gc.Chain.mlp([3, 4, 2], bias=[False, True])
    pb = Problem(chain, 0)
    W, b = _tensors(pb.W), _tensors(pb.b)
    G, Gb = _grads(pb)
    calls = []
    real = gb.plan.prepare
    monkeypatch.setattr(gb.plan, "prepare", lambda *a, **k: calls.append(1) or real(*a, **k))
    plan = gbt.KERNELS.plan(chain, W[0])
    for _ in range(3):
        got = plan.prepared(W, b, G, Gb)
        plan.prepared(W, b, G, Gb)
    assert len(calls) == 1 and len(got.meta) == chain.L
    for _ in range(2):
        with pytest.raises(ValueError, match=r"grads must be a list .* got NoneType"):
            plan.prepared(W, b, None, None)
    assert len(calls) == 3
    plan.prepared(W, b, G, Gb)
    assert len(calls) == 3
    single = [[None if a is None else a.float() for a in v] for v in (W, b, G, Gb)]
    assert plan.prepared(*single).dtype == torch.float32 and len(calls) == 4


@pytest.mark.parametrize("args", [
    lambda W, b, G, Gb: (W[0], b, G, Gb, ()), lambda W, b, G, Gb: (W, b[1], G, Gb, ()),
    lambda W, b, G, Gb: (W, b, iter(G), Gb, ()), lambda W, b, G, Gb: (W, b, G, {0: Gb[1]}, ()),
    lambda W, b, G, Gb: (W, b, G, Gb, (("momentum", iter([W[0], W[0]])),))])
def test_arguments_that_are_not_lists_get_the_cores_error(args):
    """A weight, bias, gradient or extra argument that is not a list (or tuple) of arrays
    is refused with the core's ``ValueError``, word for word, and never memoised."""
    chain = gc.Chain.mlp([3, 4, 2], bias=[False, True])
    pb = Problem(chain, 0)
    W, b = _tensors(pb.W), _tensors(pb.b)
    G, Gb = _grads(pb)
    plan = gbt.KERNELS.plan(chain, W[0])
    with pytest.raises(ValueError) as want:
        w, bb, g, gbias, extra = args(W, b, G, Gb)
        gc.arrays.prepare(chain, w, bb, grads=g, bias_grads=gbias, extra=extra)
    for _ in range(2):
        w, bb, g, gbias, extra = args(W, b, G, Gb)
        with pytest.raises(ValueError) as got:
            plan.prepared(w, bb, g, gbias, extra=extra)
        assert str(got.value) == str(want.value)


@settings(max_examples=examples(25))
@given(chain=chains(max_depth=6), seed=seeds)
@example(chain=gc.Chain((3, 4, 2, 5, 3, 2), (1, 2, 1, 3, 1)), seed=0)
@example(chain=gc.Chain((3, 4, 2, 5), (1, 2, 1)).with_skeleton_scale([2.0] * 3), seed=1)
def test_stacked_chain_products_are_the_cores_bit_for_bit(chain, seed):
    """The plan's gathered paths (``b_path``, ``f_path``) give ``B`` at every node of layers
    ``0..L-1`` and ``F`` at every node of layers ``1..L`` with each node's factors multiplied
    in the core's order: equal to :func:`gsgd_core.sweeps.chain_products` bit for bit, at
    any depth, skeleton scales included."""
    import array_api_compat.numpy as npc

    from gsgd_core.arrays import layer_meta
    from gsgd_core.sweeps import chain_products

    W, _ = random_params(chain, np.random.default_rng(seed), low=0.3, high=3.0)
    st = gb.plan.stack_in(gb.plan.stack_plan(chain), npc, "cpu", np.float64)
    ws = np.concatenate([w.reshape(-1)[s] for w, s in zip(W, st.spec)])
    B, F = fast.chain_products(npc, st, ws, np.ones(1))
    Bc, Fc = chain_products(npc, chain, layer_meta(chain, npc, "cpu"), W, np.float64, "cpu")
    assert np.array_equal(B, np.concatenate(Bc[:chain.L]))
    assert np.array_equal(F, np.concatenate(Fc[1:]))


@pytest.mark.parametrize("chain", [gc.Chain.mlp([3, 4, 2]),
                                   gc.Chain((2, 3, 1, 4), (1, 4, 2))], ids=str)
def test_a_stack_numbers_nodes_layer_by_layer_from_zero(chain):
    """``nodes[l]`` is where layer ``l`` starts (layer 0 at 0), ``edges`` where each layer's
    special edges start, and the path tables hold ``L - 1`` rows of nodes."""
    st = gb.plan.stack_plan(chain)
    assert st.nodes == tuple(int(n) for n in np.cumsum((0,) + chain.sizes))
    assert st.edges == tuple(int(n) for n in np.cumsum([0] + [s.size for s in st.spec]))
    assert st.b_path.size == (chain.L - 1) * st.nodes[chain.L]
    assert st.f_path.size == (chain.L - 1) * (st.nodes[chain.L + 1] - st.nodes[1])


def test_a_stack_goes_to_the_device_and_dtype_asked_for():
    """``stack_in`` puts every index table on the step's device (``meta`` here: any device
    other than the default) and the skeleton scales in the step's dtype as well."""
    import array_api_compat.torch as tc

    chain = gc.Chain.mlp([3, 4, 5, 2]).with_skeleton_scale([0.5, 2.0, 3.0])
    st = gb.plan.stack_in(gb.plan.stack_plan(chain), tc, "meta", torch.float32)
    tables = [a for a in st if isinstance(a, torch.Tensor)] + list(st.spec)
    assert len(tables) == 15 and {a.device.type for a in tables} == {"meta"}
    assert st.b_unit.dtype == st.f_unit.dtype == torch.float32
    assert st.tau.dtype == torch.int64 and st.moved.dtype == torch.bool


def _plan_arrays(device="cpu"):
    chain = gc.Chain.mlp([3, 4, 2], bias=[False, True])
    pb = Problem(chain, 0)
    W, b = _tensors(pb.W), _tensors(pb.b)
    G, Gb = _grads(pb)
    if device != "cpu":
        W, b, G, Gb = ([None if t is None else t.to(device) for t in v] for v in (W, b, G, Gb))
    return chain, W, b, G, Gb


class _NotAnArray:
    """Shape, dtype and device of a tensor, and nothing else."""

    def __init__(self, like):
        self.shape, self.dtype, self.device = like.shape, like.dtype, like.device


def test_a_plan_validates_anew_whatever_differs_from_the_last_call():
    """The memo of ``StepPlan.prepared`` holds for the very same signature only: another
    device, another type (not an array at all), lists cut at other places, or bad
    gradients or extra lists are each validated as the core validates them."""
    chain, W, b, G, Gb = _plan_arrays()
    plan = gbt.KERNELS.plan(chain, W[0])
    assert plan.prepared(W, b, G, Gb).device == torch.device("cpu")
    _, Wm, bm, Gm, Gbm = _plan_arrays("meta")
    assert plan.prepared(Wm, bm, Gm, Gbm).device == torch.device("meta")
    plan.prepared(W, b, G, Gb)
    with pytest.raises(ValueError, match="layer 1: weight is a _NotAnArray, not an array"):
        plan.prepared([_NotAnArray(w) for w in W], b, G, Gb)
    plan.prepared(W, b, G, Gb)
    with pytest.raises(ValueError, match="2 layers"):  # the same arrays, other lists
        plan.prepared(W + [None], b[1:], G + [None], Gb[1:])
    bad = [G[0], G[1][:1]]
    for args, extra in [((W, b, bad, Gb), ()), ((W, b, G, [None, Gb[1][:1]]), ()),
                        ((W, b, G, Gb), (("momentum", [W[0], W[0]]),))]:
        with pytest.raises(ValueError, match="layer 2") as got:
            plan.prepared(*args, extra=extra)
        with pytest.raises(ValueError) as want:
            gc.arrays.prepare(chain, *args[:2], grads=args[2], bias_grads=args[3],
                              extra=extra)
        assert str(got.value) == str(want.value)


def test_a_plans_tables_are_on_its_arrays_device():
    """A plan made for arrays on a device keeps its index tables there (``meta`` here)."""
    chain, Wm, *_ = _plan_arrays("meta")
    plan = gbt.ON_DEVICE.plan(chain, Wm[0])
    assert plan.stack.tau.device.type == "meta" and plan.stack.b_path.device.type == "meta"


# Conv slots, a flatten, a custom skeleton: rows holding no free edge and rows holding two,
# tau edges in other slots than the centre, a free tau edge.
MARKED = gc.Chain((3, 4, 2, 3), slots=(9, 4, 1), bias=[True, False, True],
                  tau=[[2, 2, 1, 0], [3, 3]], sigma=[[1, 1, 0, 0], [2, 2]],
                  skeleton_slots=(4, 1, 0))


@pytest.mark.parametrize("chain", [CHAIN, MARKED], ids=["default skeleton", "custom skeleton"])
def test_marks_find_each_layers_special_edges_and_their_places_in_the_stack(chain):
    """A layer seen as ``(n, p*k)``: each row's tau edge (``tau_col``) and each column's free
    edge (``free_row``) are the layer's tau and free edges, no more, and each points at its
    own entry among the layer's special edges (``tau_at``, ``free_at``), which the
    one-graph step writes there."""
    from array_api_compat import numpy as np_compat

    from gsgd_backends.plan import marks_of, special_edges, stack_plan
    from gsgd_core.arrays import layer_meta

    marks = marks_of(chain, stack_plan(chain), np.float32)
    assert marks.index.dtype == np.float32 and marks.at.dtype == np.int64
    for l, meta in enumerate(layer_meta(chain, np_compat, "cpu"), start=1):
        n, p, k = chain.layer_shape(l)
        m, spec = marks.layer(l), special_edges(chain, l)
        assert (m.row.tolist(), m.col.tolist()) == (list(range(n)), list(range(p * k)))
        rows = np.flatnonzero(m.tau_col >= 0)
        tau = rows * p * k + m.tau_col[rows].astype(np.int64)
        cols = np.flatnonzero(m.free_row >= 0)
        free = m.free_row[cols].astype(np.int64) * p * k + cols
        assert sorted(tau) == sorted(meta.tau_idx) and sorted(free) == sorted(meta.free_idx)
        assert np.array_equal(spec[m.tau_at[rows]], tau)
        assert np.array_equal(spec[m.free_at[cols]], free)
        assert np.all(m.tau_col[m.tau_col < 0] == -1) and np.all(m.free_row[m.free_row < 0] == -1)


@pytest.mark.parametrize("chain", [CHAIN, MARKED], ids=["default skeleton", "custom skeleton"])
def test_marks_place_special_edges_by_index_select_which_takes_no_negative_index(chain):
    """Each mark's place among its layer's special edges counts from that layer's first
    (``0 <= place < count``): the eager torch step takes them with ``index_select``."""
    from gsgd_backends.plan import marks_of, special_edges, stack_plan

    marks = marks_of(chain, stack_plan(chain), np.float64)
    for l in range(1, chain.L + 1):
        n, p, k = chain.layer_shape(l)
        m, spec = marks.layer(l), torch.from_numpy(special_edges(chain, l))
        rows, cols = np.flatnonzero(m.tau_col >= 0), np.flatnonzero(m.free_row >= 0)
        for at, want in ((m.tau_at[rows], rows * p * k + m.tau_col[rows]),
                         (m.free_at[cols], m.free_row[cols] * p * k + cols)):
            assert np.all((0 <= at) & (at < len(spec))), (l, at)
            got = torch.index_select(spec, 0, torch.from_numpy(at))
            assert got.tolist() == want.astype(np.int64).tolist()


def test_marks_compare_indices_in_the_steps_dtype_while_it_holds_them_exactly():
    """float32 holds every integer below 2**24 exactly; a layer with as many rows or
    columns (inputs times slots) compares its indices in float64. (Wide inputs and outputs:
    a wide hidden layer would make the chain's maps that long.)"""
    from gsgd_backends.plan import marks_dtype

    for chain, dtype in [(gc.Chain.mlp([2**24 - 1, 3, 2]), np.float32),
                         (gc.Chain.mlp([3, 2, 2**24 - 1]), np.float32),
                         (gc.Chain.mlp([2**24, 3, 2]), np.float64),
                         (gc.Chain.mlp([3, 2, 2**24]), np.float64),
                         (gc.Chain((2, 3, 2), slots=(2**23, 1)), np.float64)]:
        assert marks_dtype(chain, np.float32) == dtype, chain.sizes
    assert marks_dtype(gc.Chain.mlp([2**24, 3, 2]), np.float64) == np.float64


@pytest.mark.parametrize("hyper", [dict(), dict(momentum=0.9, nesterov=True, weight_decay=0.01)],
                         ids=str)
def test_compiled_step_is_one_graph_read_once_after_it(monkeypatch, hyper):
    """A compiled step is one graph, compiled on the first step and reused as the learning
    rate changes: it writes the bulk, the special edges and the biases itself (no
    write-back after it), and one read of its flags follows it; every step equals the
    core's."""
    import torch._dynamo.utils as dynamo_utils

    monkeypatch.setattr(gbt.TorchKernels, "put_", lambda *a: pytest.fail("written back"))
    pb = Problem(CHAIN, 5)
    W, b = _tensors(pb.W), _tensors(pb.b)
    state = gc.gsgd_init(CHAIN, W, b) if hyper else None
    eW, eb, estate = pb.W, pb.b, gc.gsgd_init(CHAIN, pb.W, pb.b) if hyper else None
    plan = gbt.COMPILED.plan(CHAIN, W[0])
    for step, lr in enumerate([0.1, 0.05, 0.02]):
        G, Gb = Problem(CHAIN, 10 + step).grads()
        graphs = dynamo_utils.counters["stats"]["unique_graphs"]
        with HostReads() as reads:
            assert fast.fast_step_(None, CHAIN, W, b, _tensors(G), _tensors(Gb), lr, state,
                                   plan=plan, **hyper)
        assert reads.count == {"tolist": 1}
        if not torch._dynamo.config.disable:  # TORCH_COMPILE_DISABLE=1: every stage eager
            assert dynamo_utils.counters["stats"]["unique_graphs"] - graphs == (step == 0)
        if state is not None:
            gb.inplace.assign(state.step, state.step + 1)
        eW, eb, estate = gc.gsgd_update(CHAIN, estate, eW, eb, G, Gb, lr=lr, **hyper)
        for a, e in zip(W + b, eW + eb):
            if e is not None:
                assert_close(a.numpy(), e, 1e-12)


@pytest.mark.parametrize("one_graph", [True, False])
def test_compiled_kernels_take_one_graph_unless_told_to_take_the_two_stages(one_graph):
    """Compiled kernels stage the whole step as one function, or, made with
    ``one_graph=False``, as the vector stage then the bulk stage, each compiled whole;
    either way the step equals the core's."""
    kernels = gbt.TorchKernels(gbt.CHUNK, compiled=True, one_graph=one_graph)
    staged = []
    kernels.compile = lambda fn: staged.append(fn.__name__) or fn  # traced, run eagerly
    pb = Problem(CHAIN, 5)
    W, b = _tensors(pb.W), _tensors(pb.b)
    G, Gb = pb.grads()
    assert fast.fast_step_(kernels, CHAIN, W, b, _tensors(G), _tensors(Gb), 0.1)
    assert staged == (["one_graph_stage_"] if one_graph else ["vector_stage", "bulk_stage_"])
    eW, eb = gc.gsgd_step(CHAIN, pb.W, pb.b, G, Gb, 0.1)
    for a, e in zip(W + b, eW + eb):
        if e is not None:
            assert_close(a.numpy(), e, 1e-12)
