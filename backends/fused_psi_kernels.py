"""The Triton kernel of the fused PSI-SGD(M) step (:mod:`.fused_psi`): one launch for every
row of every normalised weight.

:func:`psi_rows`: per tile of rows of a weight seen as ``(rows, rest)``, the core's
:func:`gsgd_core.psi_update` (Yi et al., Algorithm 1) in three sweeps over the tile's
columns: the rows' squared norms; the new rows' squared norms and whether every entry of a
row is finite; the new values written, by the core's per-row rules. The second and third
sweeps compute the same values, so the rows are read three times and written once, and no
row of new values is ever stored before the row is known to be kept.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fused_kernels import store_unscaled, unscaling, device_function, finite

# Fields of a row of the weight table (int64), built by gsgd_backends.fused_psi.
W_ROWS, W_REST, WFIELDS = map(tl.constexpr, range(3))
# Pointers of a weight (pointer table row): weight, gradient, momentum buffer (0 if none).
Q_W, Q_G, Q_U, QPTRS = map(tl.constexpr, range(4))


@device_function
def _new_rows(w_ptr, g_ptr, u_ptr, offs, m, sq, lr, mu, inv, DT: tl.constexpr,
              HAS_M: tl.constexpr):
    """``u' = mu u + ||w||^2 g`` and ``w' = w - lr u'`` of a block of rows (the old ``w``
    too), ``g`` read unscaled (times ``inv``): PSI-SGD (no ``HAS_M``) reads no buffer, as
    the core keeps none."""
    W = tl.load(w_ptr + offs, mask=m, other=0.0).to(DT)
    G = tl.load(g_ptr + offs, mask=m, other=0.0).to(DT) * inv
    U = sq[:, None] * G
    if HAS_M:
        U = mu * tl.load(u_ptr + offs, mask=m, other=0.0).to(DT) + U
    return W, G, U, W - lr * U


@triton.jit
def psi_rows(tiles, sizes, ptrs, lr_ptr, hyper, found, grad_scale, ST: tl.constexpr,
             DT: tl.constexpr, HAS_M: tl.constexpr, HAS_FOUND: tl.constexpr,
             UNSCALE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """One tile ``(weight, first row)``: ``BR`` rows of a weight updated in place by
    psi_update's rules (``hyper`` holds ``momentum, max_norm``): a row whose new norm passes
    ``max_norm`` is divided by it, its buffer too; a row with a non-finite gradient or new
    value keeps its old values. Nothing is written while ``found`` (GradScaler's
    ``found_inf``) is set. With ``UNSCALE`` the gradients are read unscaled by GradScaler's
    ``grad_scale`` and written back so in the rows that are written, as torch's fused
    optimizers leave them."""
    t = tl.program_id(0)
    i = tl.load(tiles + t * 2)
    r0 = tl.load(tiles + t * 2 + 1)
    go = True
    if HAS_FOUND:
        go = tl.load(found) == 0
    if go:
        n = tl.load(sizes + i * WFIELDS + W_ROWS)
        width = tl.load(sizes + i * WFIELDS + W_REST)
        w_ptr = tl.load(ptrs + i * QPTRS + Q_W).to(tl.pointer_type(ST))
        g_ptr = tl.load(ptrs + i * QPTRS + Q_G).to(tl.pointer_type(ST))
        u_ptr = tl.load(ptrs + i * QPTRS + Q_U).to(tl.pointer_type(ST))
        lr = tl.load(lr_ptr).to(DT)
        mu = tl.load(hyper)
        max_norm = tl.load(hyper + 1)
        inv = unscaling(grad_scale, DT, UNSCALE)
        rows = r0 + tl.arange(0, BR)
        rm = rows < n
        sq = tl.zeros((BR,), DT)
        for c0 in range(0, width, BC):
            cols = c0 + tl.arange(0, BC)
            m = rm[:, None] & (cols < width)[None, :]
            W = tl.load(w_ptr + rows[:, None] * width + cols[None, :], mask=m, other=0.0)
            sq += tl.sum(W.to(DT) * W.to(DT), axis=1)
        norm2 = tl.zeros((BR,), DT)
        bad = tl.zeros((BR,), tl.int32)
        for c0 in range(0, width, BC):
            cols = c0 + tl.arange(0, BC)
            m = rm[:, None] & (cols < width)[None, :]
            _, G, U, Wn = _new_rows(w_ptr, g_ptr, u_ptr, rows[:, None] * width + cols[None, :],
                                    m, sq, lr, mu, inv, DT, HAS_M)
            norm2 += tl.sum(Wn * Wn, axis=1)
            fine = finite(G) & finite(U) & finite(Wn)
            bad = tl.maximum(bad, tl.max(tl.where(m, ~fine, False).to(tl.int32), axis=1))
        norm = tl.sqrt(norm2)
        # the core's order: dividing by the norm, not multiplying by its inverse
        scale = tl.where(norm > max_norm, norm, 1.0)
        keep = rm & (bad == 0)
        for c0 in range(0, width, BC):
            cols = c0 + tl.arange(0, BC)
            offs = rows[:, None] * width + cols[None, :]
            m = keep[:, None] & (cols < width)[None, :]
            _, G, U, Wn = _new_rows(w_ptr, g_ptr, u_ptr, offs, m, sq, lr, mu, inv, DT, HAS_M)
            tl.store(w_ptr + offs, (Wn / scale[:, None]).to(ST), mask=m)
            if UNSCALE:
                store_unscaled(g_ptr, offs, m, G, ST, False)
            if HAS_M:
                tl.store(u_ptr + offs, (U / scale[:, None]).to(ST), mask=m)
