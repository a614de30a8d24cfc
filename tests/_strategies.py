"""Hypothesis strategies: chains (widths, slots, biases, custom skeletons) and their data."""

from __future__ import annotations

import contextlib

from hypothesis import settings
from hypothesis import strategies as st

from gsgd_core import Chain
from gsgd_core.reference import n_paths


def examples(n: int) -> int:
    """A test's own example count, scaled with the active profile (``n`` under "ci"'s 25
    default, ``20 n`` under "thorough"'s 500), so that ``HYPOTHESIS_PROFILE`` reaches the
    tests that set their own count."""
    return max(1, n * settings().max_examples // 25)


# JAX compiles every operation anew for each new shape (seconds per example), so on JAX the
# chains' shapes come from this short list, within the caller's limits; everything else
# (skeletons, biases, scales, data, rescalings) is drawn as on the other namespaces.
FIXED_SHAPES = [((3, 4, 2), (1, 2)), ((2, 3, 3, 2), (1, 1, 3)), ((1, 2, 1, 3), (2, 1, 1))]
_fixed_shapes = False


@contextlib.contextmanager
def fixed_shapes():
    """Draw chain shapes from :data:`FIXED_SHAPES` inside this context (the JAX fixture)."""
    global _fixed_shapes
    _fixed_shapes = True
    try:
        yield
    finally:
        _fixed_shapes = False


@st.composite
def chains(draw, max_depth=6, max_width=6, max_slots=9, custom=None, max_paths=None,
           max_edges=4000, scaled=None):
    """Chains of depth 2..max_depth, widths 1..max_width (unequal), slots 1..max_slots;
    custom skeletons and, unless ``max_paths`` asks for dense references (which work in
    the paper's units), skeleton scales (He's or drawn per layer)."""
    if _fixed_shapes:
        fits = [(n, k) for n, k in FIXED_SHAPES
                if len(k) <= max_depth and max(n) <= max_width and max(k) <= max_slots]
        sizes, slots = draw(st.sampled_from(fits or FIXED_SHAPES[:1]))
        L = len(slots)
    else:
        L = draw(st.integers(2, max_depth))
        sizes = tuple(draw(st.lists(st.integers(1, max_width), min_size=L + 1,
                                    max_size=L + 1)))
        slot = st.one_of(st.just(1), st.integers(1, max_slots))
        slots = tuple(draw(st.lists(slot, min_size=L, max_size=L)))
    bias = tuple(draw(st.lists(st.booleans(), min_size=L, max_size=L)))
    use_custom = draw(st.booleans()) if custom is None else custom
    kwargs = {}
    if use_custom:
        kwargs["tau"] = [[draw(st.integers(0, sizes[l - 1] - 1)) for _ in range(sizes[l])]
                         for l in range(1, L)]
        kwargs["sigma"] = [[draw(st.integers(0, sizes[l + 1] - 1)) for _ in range(sizes[l])]
                           for l in range(1, L)]
        kwargs["skeleton_slots"] = [draw(st.integers(0, k - 1)) for k in slots]
    chain = Chain(sizes, slots, bias=bias, **kwargs)
    if chain.m > max_edges:
        slots = (1,) * L
        kwargs.pop("skeleton_slots", None)
        chain = Chain(sizes, slots, bias=bias, **kwargs)
    if max_paths is not None and n_paths(chain) > max_paths:
        # Dense references: shrink to a chain whose paths can be enumerated.
        chain = Chain(sizes[:3], (1, 1), bias=bias[:2])
    if scaled if scaled is not None else (max_paths is None and draw(st.booleans())):
        scale = draw(st.one_of(
            st.just(chain.he_skeleton_scale()),
            st.lists(st.sampled_from([0.25, 0.5, 2.0, 3.0]), min_size=L, max_size=L)))
        chain = chain.with_skeleton_scale(scale)
    return chain


def small_chains(**kw):
    """Chains for the dense references (at most ~2,000 paths)."""
    kw.setdefault("max_depth", 4)
    kw.setdefault("max_width", 4)
    kw.setdefault("max_slots", 3)
    return chains(max_paths=2000, **kw)


seeds = st.integers(0, 2**32 - 1)


def random_params(chain, rng, low=0.5, high=1.5):
    """Weights (3-D views) and biases with magnitudes in [low, high] and random signs."""
    def draw(shape):
        return rng.choice([-1.0, 1.0], size=shape) * rng.uniform(low, high, size=shape)
    W = [draw(chain.layer_shape(l)) for l in range(1, chain.L + 1)]
    b = [draw((chain.sizes[l],)) if chain.bias[l - 1] else None for l in range(1, chain.L + 1)]
    return W, b


def random_like(params, rng):
    return [None if p is None else rng.standard_normal(p.shape) for p in params]
