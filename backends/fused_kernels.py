"""Triton kernels of the fused path-space steps (:mod:`.fused`: G-SGD(M); :mod:`.fused_adam`:
G-Adam, G-AdamW, AMSGrad): three launches for every chain.

- :func:`read_pass`: per tile of a layer's rows and columns, partial column sums of
  ``W * grad`` (layers ``l >= 2``) and the chain's finiteness flag (every weight and bias
  gradient).
- :func:`vector_stage`: one program per chain: chain products ``B``, ``F``, the backward
  sums ``T`` (ICR, DESIGN §3), the tau edges' path ratios and ``rho`` (weight allocation,
  §4), the special edges, biases and step counter written in place.
- :func:`write_pass`: per tile of every layer of every chain, the bulk update by the core's
  per-entry rules (:func:`gsgd_backends.fast.rows_by_rules`), the special edges masked off.

The step rule is a constexpr bit set ``RULE`` of the ``R_*`` flags: SGD's direction
(weight decay, momentum, Nesterov) or Adam's (:class:`gsgd_core.AdamRule`: L2 or decoupled
weight decay, AMSGrad), with the rule's buffers (momentum; ``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq``) in pointer slots ``P_M`` (weights) and ``P_MB`` (biases), of the buffer
dtype ``BT``. Every per-entry rule is :mod:`gsgd_core.rules`' written once more in Triton
(the helpers below, each named after its rule). Tensors are reached through tables of
``data_ptr()``s (the layer table of :mod:`.fused` lists the fields); node vectors live in a
workspace of the compute dtype. A step whose chain has a non-finite gradient, or whose
``found_inf`` is set, writes nothing: the vector stage reads the flag and hands it to the
write pass.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Compiled kernels read only globals that are constexpr (``.value`` is the number).
# Fields of a row of the layer table (int64), built by gsgd_backends.fused.
(CHAIN, POS, DEPTH, ROWS, UNITS, SLOTS, IN_NODE, OUT_NODE, TAU_IDX, TAU_SRC, TAU_FREE, FREE_IDX,
 SIGMA, CARRY_PTR, CARRY_IDX, CARRY_MAX, PART, CHUNKS, HAS_BIAS, FIELDS) = map(tl.constexpr,
                                                                                range(20))
# Pointers of a layer (pointer table row): weight, gradient, bias, its gradient, the column
# sums given for it, then three slots of the rule's weight buffers from P_M and three of its
# bias buffers from P_MB (0 where none).
P_W, P_G, P_B, P_GB, P_S, P_M, P_MB, PTRS = map(tl.constexpr, (0, 1, 2, 3, 4, 5, 8, 11))
# A chain's row of the table of its counters: the step counter and the gradients' check.
S_STEP, S_CHECK, SFIELDS = map(tl.constexpr, range(3))
# A chain's row of the chain table: its first layer, depth, workspace offset, node count.
C_FIRST, C_DEPTH, C_WS, C_NODES, CFIELDS = map(tl.constexpr, range(5))
# A chain's row of the step coefficients the vector stage hands the write pass: whether the
# step is the first (SGD's momentum), Adam's lr / (1 - beta1**t) and sqrt(1 - beta2**t).
K_FIRST, K_STEP, K_BC2, KFIELDS = map(tl.constexpr, range(4))
# Flags of RULE (test them as ``R_X & RULE``: the interpreter passes RULE as an int).
# R_WD: weight decay added to D (SGD's, Adam's L2); R_DECOUPLED: AdamW's.
R_WD, R_M, R_NESTEROV, R_ADAM, R_AMSGRAD, R_DECOUPLED = map(tl.constexpr, (1, 2, 4, 8, 16, 32))


def device_function(fn):
    """A device function of the kernels: compiled with them by Triton, or, under the
    interpreter, a plain Python function run inside the interpreted kernel (the
    interpreter patches the language module once per launch, not once per call, which
    makes the tests several times faster; the operations are the same)."""
    return fn if _interpreting() else triton.jit(fn)


def _interpreting() -> bool:
    """Whether Triton interprets the kernels defined now: its ``knobs``, or, in a triton
    without them (3.2), the variable it reads."""
    try:
        from triton import knobs
    except ImportError:
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    return knobs.runtime.interpret


@device_function
def _field(table, row, field: tl.constexpr, width: tl.constexpr):
    return tl.load(table + row * width + field)


@device_function
def _ptr(ptrs, layer, which: tl.constexpr, ST: tl.constexpr):
    return tl.load(ptrs + layer * PTRS + which).to(tl.pointer_type(ST))


@device_function
def _counter(steps, chain, which: tl.constexpr, T: tl.constexpr):
    return tl.load(steps + chain * SFIELDS + which).to(tl.pointer_type(T))


#: Infinity, for the finiteness test.
INF = tl.constexpr(float("inf"))


@device_function
def finite(x):
    """rules.finite_mask: ``|x| < inf``, false for NaN and both infinities. (Not the core's
    ``x - x == 0``: compiled, a product ``x = a * b`` and the subtraction contract into one
    fused multiply-add, ``fma(a, b, -x)``, the product's rounding error, which is 0 only by
    chance.)"""
    return tl.abs(x) < INF


@device_function
def _safe_div(num, den):
    """rules.safe_div: 0 where ``den == 0``."""
    zero = den == 0
    return tl.where(zero, 0.0, num / tl.where(zero, 1.0, den))


@device_function
def _scaled_div(lr, num, den):
    """rules.scaled_div with a 0-d ``lr``: ``lr * num / den`` in the order that overflows
    only where the value does."""
    small = tl.abs(lr) <= 1
    return tl.where(small, 1.0, lr) * _safe_div(tl.where(small, lr, 1.0) * num, den)


@device_function
def _path_gradient(num, den, g):
    """rules.path_gradient: ``num / den``, 0 where it overflows from a finite ``g``."""
    D = _safe_div(num, den)
    return tl.where(finite(D) | ~finite(g), D, 0.0)


@device_function
def _direction(D, M, V, first, hyper, RULE: tl.constexpr):
    """rules.direction: weight decay, then momentum (torch.optim.SGD's conventions),
    ``hyper = (momentum, dampening, weight_decay)``. Returns the direction and the new
    buffer (``D`` itself without momentum)."""
    if R_WD & RULE:
        D = D + tl.load(hyper + 2) * V
    Mn = D
    out = D
    if R_M & RULE:
        mu = tl.load(hyper)
        Mn = tl.where(first, D, mu * M + (1.0 - tl.load(hyper + 1)) * D)
        if R_NESTEROV & RULE:
            out = D + mu * Mn
        else:
            out = Mn
    return out, Mn


@device_function
def _adam(D, V, M, S, X, lr, hyper, step_size, sqrt_bc2, RULE: tl.constexpr,
          DT: tl.constexpr):
    """AdamRule.apply, ``hyper = (beta1, 1 - beta1, beta2, 1 - beta2, eps, weight_decay)``,
    ``step_size = lr / (1 - beta1**t)``, ``sqrt_bc2 = sqrt(1 - beta2**t)``::

        D <- D + weight_decay * V                (R_WD)
        m = beta1 M + (1 - beta1) D,  s = beta2 S + (1 - beta2) D**2,  X' = max(X, s)
        Delta = step_size m / (sqrt(s or X') / sqrt_bc2 + eps)
        Delta <- Delta + lr weight_decay V      (R_DECOUPLED)

    and a ``Delta`` that is not finite is 0 (rules.finite_or_zero). Returns ``(Delta, m,
    s, X')``."""
    wd = tl.load(hyper + 5)
    if R_WD & RULE:
        D = D + wd * V
    m = tl.load(hyper) * M + tl.load(hyper + 1) * D
    s = tl.load(hyper + 2) * S + tl.load(hyper + 3) * (D * D)
    Xn = X
    den = s
    if R_AMSGRAD & RULE:
        Xn = tl.maximum(X, s)
        den = Xn
    delta = step_size * m / (_sqrt(den, DT) / sqrt_bc2 + tl.load(hyper + 4))
    if R_DECOUPLED & RULE:
        delta = delta + (lr * wd) * V
    return tl.where(finite(delta), delta, 0.0), m, s, Xn


@device_function
def _rule(D, V, M, S, X, first, lr, hyper, step_size, sqrt_bc2, RULE: tl.constexpr,
          DT: tl.constexpr):
    """The rule's step at paths ``(D, V)`` with buffers ``M, S, X`` (those the rule has):
    ``(step, M', S', X')``; the path moves by ``_over(step, V, lr, RULE)``."""
    if R_ADAM & RULE:
        step, Mn, Sn, Xn = _adam(D, V, M, S, X, lr, hyper, step_size, sqrt_bc2, RULE, DT)
    else:
        step, Mn = _direction(D, M, V, first, hyper, RULE)
        Sn = S
        Xn = X
    return step, Mn, Sn, Xn


@device_function
def _over(step, den, lr, RULE: tl.constexpr):
    """A step over ``den``: Adam's holds ``lr`` (rules.safe_div), SGD's direction is
    scaled by it (rules.scaled_div)."""
    if R_ADAM & RULE:
        out = _safe_div(step, den)
    else:
        out = _scaled_div(lr, step, den)
    return out


@device_function
def _sqrt(x, DT: tl.constexpr):
    """The correctly rounded square root (``tl.sqrt`` of float32 is approximate on GPUs;
    ``tl.sqrt_rn`` takes float32 only)."""
    if DT == tl.float32:
        out = tl.sqrt_rn(x)
    else:
        out = tl.sqrt(x)
    return out


@device_function
def _power(b, t):
    """``b**t`` for an integer ``t`` of 1 to 2**31 - 1, by squaring (``t``'s bits)."""
    out = b * 0.0 + 1.0
    for i in range(0, 31):
        out = tl.where(((t >> i) & 1) != 0, out * b, out)
        b = b * b
    return out


@device_function
def _buffers(ptrs, li, offs, mask, zero, FIRST: tl.constexpr, RULE: tl.constexpr,
             BT: tl.constexpr, DT: tl.constexpr):
    """The rule's buffers at ``offs`` of layer ``li``'s slots from ``FIRST`` (``P_M``:
    the weight's, ``P_MB``: the bias's), ``zero`` for those the rule has not."""
    M = zero
    S = zero
    X = zero
    if (R_M | R_ADAM) & RULE:
        M = tl.load(_ptr(ptrs, li, FIRST, BT) + offs, mask=mask, other=0.0).to(DT)
    if R_ADAM & RULE:
        S = tl.load(_ptr(ptrs, li, FIRST + 1, BT) + offs, mask=mask, other=0.0).to(DT)
    if R_AMSGRAD & RULE:
        X = tl.load(_ptr(ptrs, li, FIRST + 2, BT) + offs, mask=mask, other=0.0).to(DT)
    return M, S, X


@device_function
def _store_buffers(ptrs, li, offs, mask, Mn, Sn, Xn, M, S, X, FIRST: tl.constexpr,
                   RULE: tl.constexpr, BT: tl.constexpr):
    """:func:`_buffers`' new values where ``mask``, each kept where not finite (rules.kept)."""
    if (R_M | R_ADAM) & RULE:
        tl.store(_ptr(ptrs, li, FIRST, BT) + offs, _kept(Mn, M).to(BT), mask=mask)
    if R_ADAM & RULE:
        tl.store(_ptr(ptrs, li, FIRST + 1, BT) + offs, _kept(Sn, S).to(BT), mask=mask)
    if R_AMSGRAD & RULE:
        tl.store(_ptr(ptrs, li, FIRST + 2, BT) + offs, _kept(Xn, X).to(BT), mask=mask)


@device_function
def _kept(new, old):
    """rules.kept: ``new`` where finite, else ``old``."""
    return tl.where(finite(new), new, old)


@device_function
def _and(mask, flag):
    """``mask & flag`` for a scalar ``flag`` (the interpreter turns ``&`` of a vector and
    a scalar into integers, which a mask may not be)."""
    return tl.where(flag, mask, False)


@device_function
def unscaling(scale, DT: tl.constexpr, UNSCALE: tl.constexpr):
    """The factor the gradients are read with: 1, or with ``UNSCALE`` the inverse of
    GradScaler's ``scale``, rounded as its unscaling rounds it (the reciprocal in float64,
    then float32), so that a gradient reads as ``scaler.unscale_`` would leave it."""
    inv = 1.0
    if UNSCALE:
        inv = (1.0 / tl.load(scale).to(tl.float64)).to(tl.float32).to(DT)
    return inv


@device_function
def _grad(ptr, offs, mask, inv, DT: tl.constexpr, MAXIMIZE: tl.constexpr):
    """A gradient as the step reads it: unscaled (times ``inv``), negated to maximise."""
    g = tl.load(ptr + offs, mask=mask, other=0.0).to(DT) * inv
    if MAXIMIZE:
        g = -g
    return g


@device_function
def store_unscaled(ptr, offs, mask, g, ST: tl.constexpr, MAXIMIZE: tl.constexpr):
    """The unscaled gradient ``g`` (as :func:`_grad` read it) written back in place, as
    torch's fused optimizers leave GradScaler's gradients."""
    if MAXIMIZE:
        g = -g
    tl.store(ptr + offs, g.to(ST), mask=mask)


@triton.jit
def read_pass(tiles, layers, ptrs, part, flag, scale, ST: tl.constexpr, DT: tl.constexpr,
              MAXIMIZE: tl.constexpr, UNSCALE: tl.constexpr, ROWS_PER: tl.constexpr,
              BR: tl.constexpr, BC: tl.constexpr):
    """One tile ``(layer, kind, row chunk, first column)``: the columns' partial sums of
    ``W * grad`` over the chunk's rows into ``part`` (where the layer has a ``PART``
    offset), and the chain's flag set if a gradient entry (weight, or bias for ``kind``
    1) is not finite; gradients read unscaled by GradScaler's ``scale`` (``UNSCALE``)."""
    t = tl.program_id(0)
    li = tl.load(tiles + t * 4)
    kind = tl.load(tiles + t * 4 + 1)
    chunk = tl.load(tiles + t * 4 + 2)
    c0 = tl.load(tiles + t * 4 + 3)
    chain = _field(layers, li, CHAIN, FIELDS)
    bias = kind == 1  # a bias gradient: one row of n entries, no sum
    n = _field(layers, li, ROWS, FIELDS)
    units = _field(layers, li, UNITS, FIELDS)
    width = tl.where(bias, n, units * _field(layers, li, SLOTS, FIELDS))
    n = tl.where(bias, 1, n)
    poff = tl.where(bias, -1, _field(layers, li, PART, FIELDS))
    g_ptr = tl.load(ptrs + li * PTRS + P_G + kind * (P_GB - P_G)).to(tl.pointer_type(ST))
    w_ptr = _ptr(ptrs, li, P_W, ST)
    cols = c0 + tl.arange(0, BC)
    cm = cols < width
    acc = tl.zeros((BC,), DT)
    bad = tl.zeros((BC,), tl.int1)
    r_end = tl.minimum(n, (chunk + 1) * ROWS_PER)
    inv = unscaling(scale, DT, UNSCALE)
    for r0 in range(chunk * ROWS_PER, r_end, BR):
        rows = r0 + tl.arange(0, BR)
        m = (rows < r_end)[:, None] & cm[None, :]
        offs = rows[:, None] * width + cols[None, :]
        g = _grad(g_ptr, offs, m, inv, DT, MAXIMIZE)
        bad = bad | tl.max((~finite(g) & m).to(tl.int32), axis=0).to(tl.int1)
        if poff >= 0:
            w = tl.load(w_ptr + offs, mask=m, other=0.0).to(DT)
            acc += tl.sum(w * g, axis=0)
    if poff >= 0:
        tl.store(part + poff + chunk * width + cols, acc, mask=cm)
    tl.store(flag + chain, 1, mask=tl.max(bad.to(tl.int32), axis=0) > 0)


@device_function
def _products(layers, ptrs, idx, scale, Bw, Fw, Rw, li0, L, ST: tl.constexpr,
              DT: tl.constexpr, BLOCK: tl.constexpr):
    """Chain products (core's sweeps.chain_products, in its order): ``B`` at the nodes of
    layers ``0..L-1`` along tau edges, ``F`` at layers ``1..L`` along free edges, each
    factor in units of the layer's skeleton scale; ``rho_0 = 1``."""
    n0 = _field(layers, li0, UNITS, FIELDS)
    for j0 in range(0, n0, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        tl.store(Bw + j, tl.full((BLOCK,), 1.0, DT), mask=j < n0)
        tl.store(Rw + j, tl.full((BLOCK,), 1.0, DT), mask=j < n0)
    top = li0 + L - 1
    nL = _field(layers, top, ROWS, FIELDS)
    for j0 in range(0, nL, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        tl.store(Fw + _field(layers, top, OUT_NODE, FIELDS) + j, tl.full((BLOCK,), 1.0, DT),
                 mask=j < nL)
    tl.debug_barrier()
    for l in range(1, L):
        _factors(layers, ptrs, idx, scale, Bw, li0 + l - 1, ROWS, TAU_IDX, TAU_SRC, IN_NODE,
                 OUT_NODE, ST, DT, BLOCK)
    for q in range(0, L - 1):  # layer l + 1 holds the free edges out of layer l's nodes
        _factors(layers, ptrs, idx, scale, Fw, li0 + L - 1 - q, UNITS, FREE_IDX, SIGMA,
                 OUT_NODE, IN_NODE, ST, DT, BLOCK)


@device_function
def _factors(layers, ptrs, idx, scale, vec, li, COUNT: tl.constexpr, EDGE: tl.constexpr,
             LINK: tl.constexpr, FROM: tl.constexpr, TO: tl.constexpr, ST: tl.constexpr,
             DT: tl.constexpr, BLOCK: tl.constexpr):
    """One layer's step of a chain product: ``vec[TO + j] = vec[FROM + link[j]] * w[edge[j]]
    / r`` for the ``COUNT`` nodes of layer ``li``'s field (``B`` along tau edges: ``TAU_IDX``,
    ``TAU_SRC``; ``F`` along free edges: ``FREE_IDX``, ``SIGMA``)."""
    n = _field(layers, li, COUNT, FIELDS)
    w_ptr = _ptr(ptrs, li, P_W, ST)
    r = tl.load(scale + li)
    for j0 in range(0, n, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        m = j < n
        link = tl.load(idx + _field(layers, li, LINK, FIELDS) + j, mask=m, other=0)
        w = tl.load(w_ptr + tl.load(idx + _field(layers, li, EDGE, FIELDS) + j, mask=m,
                                    other=0), mask=m, other=0.0).to(DT)
        prev = tl.load(vec + _field(layers, li, FROM, FIELDS) + link, mask=m, other=0.0)
        tl.store(vec + _field(layers, li, TO, FIELDS) + j, prev * (w / r), mask=m)
    tl.debug_barrier()


@device_function
def _backward_sums(layers, ptrs, idx, part, Tw, li0, L, inv, ST: tl.constexpr,
                   DT: tl.constexpr, MAXIMIZE: tl.constexpr, GIVEN: tl.constexpr,
                   BLOCK: tl.constexpr):
    """ICR's backward sweep (fast.backward_sums, layer by layer from the top)::

        T_{l-1} = colsum(W_l * grad_l) - P_l[free edges] + sum of T_l over the nodes whose
                  free tau edge leaves that node

    the column sums from the read pass's partials (summed over row chunks and slots) or, if
    ``GIVEN``, the caller's (of ``W * grad``, negated with ``MAXIMIZE``), the carried sums
    through a per-layer CSR list of those nodes."""
    for q in range(0, L - 1):
        li = li0 + L - 1 - q
        p = _field(layers, li, UNITS, FIELDS)
        k = _field(layers, li, SLOTS, FIELDS)
        width = p * k
        poff = _field(layers, li, PART, FIELDS)
        chunks = _field(layers, li, CHUNKS, FIELDS)
        w_ptr = _ptr(ptrs, li, P_W, ST)
        g_ptr = _ptr(ptrs, li, P_G, ST)
        out_node = _field(layers, li, OUT_NODE, FIELDS)
        cptr = _field(layers, li, CARRY_PTR, FIELDS)
        cidx = _field(layers, li, CARRY_IDX, FIELDS)
        for a0 in range(0, p, BLOCK):
            a = a0 + tl.arange(0, BLOCK)
            m = a < p
            if GIVEN:
                acc = _grad(_ptr(ptrs, li, P_S, ST), a, m, inv, DT, MAXIMIZE)
            else:
                acc = tl.zeros((BLOCK,), DT)
                for ch in range(0, chunks):
                    for s in range(0, k):
                        acc += tl.load(part + poff + ch * width + a * k + s, mask=m, other=0.0)
            fi = tl.load(idx + _field(layers, li, FREE_IDX, FIELDS) + a, mask=m, other=0)
            w = tl.load(w_ptr + fi, mask=m, other=0.0).to(DT)
            T = acc - w * _grad(g_ptr, fi, m, inv, DT, MAXIMIZE)
            start = tl.load(idx + cptr + a, mask=m, other=0)
            end = tl.load(idx + cptr + a + 1, mask=m, other=0)
            for c in range(0, _field(layers, li, CARRY_MAX, FIELDS)):
                cm = m & (start + c < end)
                b = tl.load(idx + cidx + start + c, mask=cm, other=0)
                T += tl.load(Tw + out_node + b, mask=cm, other=0.0)
            tl.store(Tw + _field(layers, li, IN_NODE, FIELDS) + a, T, mask=m)
        tl.debug_barrier()


@device_function
def _tau_edges(layers, ptrs, idx, Bw, Fw, Rw, Tw, li0, L, ok, first, lr, hyper, step_size,
               sqrt_bc2, eps, inv, ST: tl.constexpr, DT: tl.constexpr, BT: tl.constexpr,
               RULE: tl.constexpr, MAXIMIZE: tl.constexpr, BLOCK: tl.constexpr):
    """Weight allocation's forward sweep on the tau edges (sweeps.allocate3): ``D = (w g -
    T) / V``, the rule's step, ``R = 1 - step / V`` (0 -> eps), the tau edge ``w R /
    rho_src`` (rules.written_ratio: kept where not finite, ``rho`` then the source's), and
    ``rho`` (a free tau edge passes its source's on). Tau edges that are not free, and
    their buffers, are written when ``ok``."""
    for l in range(1, L):
        li = li0 + l - 1
        n = _field(layers, li, ROWS, FIELDS)
        in_node = _field(layers, li, IN_NODE, FIELDS)
        out_node = _field(layers, li, OUT_NODE, FIELDS)
        w_ptr = _ptr(ptrs, li, P_W, ST)
        g_ptr = _ptr(ptrs, li, P_G, ST)
        for j0 in range(0, n, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            m = j < n
            ti = tl.load(idx + _field(layers, li, TAU_IDX, FIELDS) + j, mask=m, other=0)
            src = tl.load(idx + _field(layers, li, TAU_SRC, FIELDS) + j, mask=m, other=0)
            free = tl.load(idx + _field(layers, li, TAU_FREE, FIELDS) + j, mask=m, other=1) != 0
            w = tl.load(w_ptr + ti, mask=m, other=0.0).to(DT)
            g = _grad(g_ptr, ti, m, inv, DT, MAXIMIZE)
            V = (tl.load(Fw + out_node + j, mask=m, other=0.0)
                 * tl.load(Bw + in_node + src, mask=m, other=0.0)) * w
            D = _path_gradient(w * g - tl.load(Tw + out_node + j, mask=m, other=0.0), V, g)
            M, S, X = _buffers(ptrs, li, ti, m, tl.zeros((BLOCK,), DT), P_M, RULE, BT, DT)
            step, Mn, Sn, Xn = _rule(D, V, M, S, X, first, lr, hyper, step_size, sqrt_bc2,
                                     RULE, DT)
            R = 1.0 - _over(step, V, lr, RULE)
            R = tl.where(R == 0, eps, R)
            rho_src = tl.load(Rw + in_node + src, mask=m, other=1.0)
            new = w * (R / rho_src)
            written = finite(new)
            tl.store(Rw + out_node + j, tl.where(free | ~written, rho_src, R), mask=m)
            moved = _and(m & ~free, ok)
            tl.store(w_ptr + ti, tl.where(written, new, w).to(ST), mask=moved)
            _store_buffers(ptrs, li, ti, moved, Mn, Sn, Xn, M, S, X, P_M, RULE, BT)
        tl.debug_barrier()


@device_function
def _free_buffers(layers, ptrs, idx, li0, L, ok, first, lr, hyper, step_size, sqrt_bc2,
                  DT: tl.constexpr, BT: tl.constexpr, RULE: tl.constexpr,
                  BLOCK: tl.constexpr):
    """The rule's buffers at free edges: no path, ``D = V = 0`` (the core's icr3)."""
    for l in range(2, L + 1):
        li = li0 + l - 1
        p = _field(layers, li, UNITS, FIELDS)
        for a0 in range(0, p, BLOCK):
            a = a0 + tl.arange(0, BLOCK)
            m = a < p
            fi = tl.load(idx + _field(layers, li, FREE_IDX, FIELDS) + a, mask=m, other=0)
            zero = tl.zeros((BLOCK,), DT)
            M, S, X = _buffers(ptrs, li, fi, m, zero, P_M, RULE, BT, DT)
            _, Mn, Sn, Xn = _rule(zero, zero, M, S, X, first, lr, hyper, step_size, sqrt_bc2,
                                  RULE, DT)
            _store_buffers(ptrs, li, fi, _and(m, ok), Mn, Sn, Xn, M, S, X, P_M, RULE, BT)


@device_function
def _biases(layers, ptrs, Fw, li0, L, ok, first, lr, hyper, step_size, sqrt_bc2, inv,
            ST: tl.constexpr, DT: tl.constexpr, BT: tl.constexpr, RULE: tl.constexpr,
            MAXIMIZE: tl.constexpr, UNSCALE: tl.constexpr, BLOCK: tl.constexpr):
    """The core's bias rule: ``Db = grad_b / F`` (frozen on overflow), the rule's step with
    ``Vb = b F``, ``b' = b - step / F``, kept where not finite; with ``UNSCALE`` the
    unscaled gradient written back where the step is taken."""
    for l in range(1, L + 1):
        li = li0 + l - 1
        if _field(layers, li, HAS_BIAS, FIELDS) != 0:
            n = _field(layers, li, ROWS, FIELDS)
            out_node = _field(layers, li, OUT_NODE, FIELDS)
            b_ptr = _ptr(ptrs, li, P_B, ST)
            gb_ptr = _ptr(ptrs, li, P_GB, ST)
            for j0 in range(0, n, BLOCK):
                j = j0 + tl.arange(0, BLOCK)
                m = j < n
                F = tl.load(Fw + out_node + j, mask=m, other=1.0)
                b = tl.load(b_ptr + j, mask=m, other=0.0).to(DT)
                g = _grad(gb_ptr, j, m, inv, DT, MAXIMIZE)
                M, S, X = _buffers(ptrs, li, j, m, tl.zeros((BLOCK,), DT), P_MB, RULE, BT, DT)
                step, Mn, Sn, Xn = _rule(_path_gradient(g, F, g), b * F, M, S, X, first, lr,
                                         hyper, step_size, sqrt_bc2, RULE, DT)
                tl.store(b_ptr + j, _kept(b - _over(step, F, lr, RULE), b).to(ST),
                         mask=_and(m, ok))
                _store_buffers(ptrs, li, j, _and(m, ok), Mn, Sn, Xn, M, S, X, P_MB, RULE, BT)
                if UNSCALE:
                    store_unscaled(gb_ptr, j, _and(m, ok), g, ST, MAXIMIZE)


@triton.jit
def vector_stage(chains, layers, ptrs, steps, idx, scale, part, ws, flag, okbuf, found,
                 grad_scale, lr_ptr, hyper, coefs, eps, ST: tl.constexpr, DT: tl.constexpr,
                 BT: tl.constexpr, RULE: tl.constexpr, MAXIMIZE: tl.constexpr,
                 HAS_STEP: tl.constexpr, HAS_FOUND: tl.constexpr, GIVEN: tl.constexpr,
                 UNSCALE: tl.constexpr, BLOCK: tl.constexpr):
    """One program per chain: the read pass's flag (and ``found_inf``) decide the step,
    handed to the write pass in ``okbuf`` (the flag is cleared for the next step; with
    ``GIVEN`` column sums, the caller's gradient check must be finite too); the step's
    coefficients from the step counter (a row of ``coefs``, for the write pass); then the
    node-vector work of the step on the chain's workspace, the special edges, biases, their
    buffers and the step counter written in place where the step is taken."""
    c = tl.program_id(0)
    li0 = _field(chains, c, C_FIRST, CFIELDS)
    L = _field(chains, c, C_DEPTH, CFIELDS)
    nodes = _field(chains, c, C_NODES, CFIELDS)
    Bw = ws + _field(chains, c, C_WS, CFIELDS)
    Fw = Bw + nodes
    Rw = Fw + nodes
    Tw = Rw + nodes
    ok = tl.load(flag + c) == 0
    if HAS_FOUND:
        ok = ok & (tl.load(found) == 0)
    if GIVEN:
        ok = ok & finite(tl.load(_counter(steps, c, S_CHECK, ST)).to(DT))
    tl.store(okbuf + c, ok.to(tl.int32))
    tl.store(flag + c, 0)
    lr = tl.load(lr_ptr).to(DT)
    inv = unscaling(grad_scale, DT, UNSCALE)
    first = False
    step_size = lr
    sqrt_bc2 = lr
    if HAS_STEP:
        step_ptr = _counter(steps, c, S_STEP, tl.int32)
        count = tl.load(step_ptr)
        first = count == 0
        if R_ADAM & RULE:  # AdamRule.coefficients at t = count + 1
            step_size = lr / (1.0 - _power(tl.load(hyper), count + 1))
            sqrt_bc2 = _sqrt(1.0 - _power(tl.load(hyper + 2), count + 1), DT)
        row = coefs + c * KFIELDS
        tl.store(row + K_FIRST, first.to(DT))
        tl.store(row + K_STEP, step_size)
        tl.store(row + K_BC2, sqrt_bc2)
    _products(layers, ptrs, idx, scale, Bw, Fw, Rw, li0, L, ST, DT, BLOCK)
    _backward_sums(layers, ptrs, idx, part, Tw, li0, L, inv, ST, DT, MAXIMIZE, GIVEN, BLOCK)
    _tau_edges(layers, ptrs, idx, Bw, Fw, Rw, Tw, li0, L, ok, first, lr, hyper, step_size,
               sqrt_bc2, eps, inv, ST, DT, BT, RULE, MAXIMIZE, BLOCK)
    if (R_M | R_ADAM) & RULE:
        _free_buffers(layers, ptrs, idx, li0, L, ok, first, lr, hyper, step_size, sqrt_bc2,
                      DT, BT, RULE, BLOCK)
    _biases(layers, ptrs, Fw, li0, L, ok, first, lr, hyper, step_size, sqrt_bc2, inv, ST, DT,
            BT, RULE, MAXIMIZE, UNSCALE, BLOCK)
    if HAS_STEP:
        tl.store(step_ptr, count + 1, mask=ok)


@triton.jit
def write_pass(tiles, chains, layers, ptrs, coefs, idx, ws, okbuf, lr_ptr, hyper, grad_scale,
               ST: tl.constexpr, DT: tl.constexpr, BT: tl.constexpr, RULE: tl.constexpr,
               MAXIMIZE: tl.constexpr, UNSCALE: tl.constexpr, BR: tl.constexpr,
               BC: tl.constexpr):
    """One tile ``(layer, first row, first column)`` of a layer seen as ``(n, p*k)``: the
    bulk update (fast.rows_by_rules, rule_step.rule_bulk_) ``W' = (W - step / (F B)) /
    rho`` with ``D = grad / (F B)``, ``V = F B W`` and the rule's step and buffers, every
    entry by the core's rules; tau and free edges (found by their flat indices) are the
    vector stage's and are not written. With ``UNSCALE`` the gradients are read unscaled
    by GradScaler's ``grad_scale`` and, every entry of the tile (the vector stage has read
    the special edges'), written back so, as torch's fused optimizers leave them."""
    t = tl.program_id(0)
    li = tl.load(tiles + t * 3)
    r0 = tl.load(tiles + t * 3 + 1)
    c0 = tl.load(tiles + t * 3 + 2)
    c = _field(layers, li, CHAIN, FIELDS)
    if tl.load(okbuf + c) != 0:
        nodes = _field(chains, c, C_NODES, CFIELDS)
        Bw = ws + _field(chains, c, C_WS, CFIELDS)
        Fw = Bw + nodes
        Rw = Fw + nodes
        n = _field(layers, li, ROWS, FIELDS)
        k = _field(layers, li, SLOTS, FIELDS)
        width = _field(layers, li, UNITS, FIELDS) * k
        pos = _field(layers, li, POS, FIELDS)
        rows = r0 + tl.arange(0, BR)
        cols = c0 + tl.arange(0, BC)
        rm = rows < n
        cm = cols < width
        a = cols // k
        F = tl.load(Fw + _field(layers, li, OUT_NODE, FIELDS) + rows, mask=rm, other=1.0)
        in_node = _field(layers, li, IN_NODE, FIELDS)
        B = tl.load(Bw + in_node + a, mask=cm, other=1.0)
        rho = tl.load(Rw + in_node + a, mask=cm, other=1.0)
        tau = tl.load(idx + _field(layers, li, TAU_IDX, FIELDS) + rows,
                      mask=_and(rm, pos < _field(layers, li, DEPTH, FIELDS)), other=-1)
        free = tl.load(idx + _field(layers, li, FREE_IDX, FIELDS) + a, mask=_and(cm, pos > 1),
                       other=-1)
        offs = rows[:, None] * width + cols[None, :]
        tile = rm[:, None] & cm[None, :]
        m = tile & (offs != tau[:, None]) & (offs != free[None, :])
        w_ptr = _ptr(ptrs, li, P_W, ST)
        W = tl.load(w_ptr + offs, mask=m, other=0.0).to(DT)
        g_ptr = _ptr(ptrs, li, P_G, ST)
        G = _grad(g_ptr, offs, tile, unscaling(grad_scale, DT, UNSCALE), DT, MAXIMIZE)
        M, S, X = _buffers(ptrs, li, offs, m, tl.zeros((BR, BC), DT), P_M, RULE, BT, DT)
        lr = tl.load(lr_ptr).to(DT)
        first = False
        step_size = lr
        sqrt_bc2 = lr
        if (R_M | R_ADAM) & RULE:
            row = coefs + c * KFIELDS
            first = tl.load(row + K_FIRST) != 0
            step_size = tl.load(row + K_STEP)
            sqrt_bc2 = tl.load(row + K_BC2)
        fb = F[:, None] * B[None, :]
        step, Mn, Sn, Xn = _rule(_path_gradient(G, fb, G), fb * W, M, S, X, first, lr, hyper,
                                 step_size, sqrt_bc2, RULE, DT)
        new = (W - _over(step, fb, lr, RULE)) / rho[None, :]
        tl.store(w_ptr + offs, _kept(new, W).to(ST), mask=m)
        _store_buffers(ptrs, li, offs, m, Mn, Sn, Xn, M, S, X, P_M, RULE, BT)
        if UNSCALE:
            store_unscaled(g_ptr, offs, tile, G, ST, MAXIMIZE)
