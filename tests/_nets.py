"""A reference network for any chain, in PyTorch float64: gradients come from autograd.

Every layer is a 1-D convolution with ``padding='same'`` over ``P`` positions, kernel
``k_l`` (the chain's slots), ReLU between layers: positively homogeneous per channel, so the
chain's group acts on it exactly. A Linear is the case ``k = 1``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as tF

POSITIONS = 3


def make_data(chain, rng, batch=6):
    x = rng.standard_normal((batch, chain.sizes[0], POSITIONS))
    y = rng.standard_normal((batch, chain.sizes[-1], POSITIONS))
    return x, y


def forward(chain, W, b, x):
    """Network output for torch tensors ``W`` (3-D views or any layer shape) and biases."""
    h = x
    for l in range(1, chain.L + 1):
        w = W[l - 1].reshape(chain.layer_shape(l))
        k = w.shape[-1]  # "same" padding, done by hand so even kernels need no copy warning
        h = tF.conv1d(tF.pad(h, ((k - 1) // 2, k // 2)), w, b[l - 1])
        if l < chain.L:
            h = torch.relu(h)
    return h


def loss_fn(chain, W, b, x, y):
    return 0.5 * ((forward(chain, W, b, x) - y) ** 2).mean()


def _t(a, requires_grad=False):
    return None if a is None else torch.tensor(np.asarray(a, dtype=np.float64),
                                               requires_grad=requires_grad)


def output(chain, W, b, x) -> np.ndarray:
    with torch.no_grad():
        return forward(chain, [_t(w) for w in W], [_t(v) for v in b], _t(x)).numpy()


def loss_and_grads(chain, W, b, x, y):
    """Loss and its gradients (host float64) at host weights ``W``, biases ``b``."""
    Wt = [_t(w, True) for w in W]
    bt = [_t(v, True) for v in b]
    loss = loss_fn(chain, Wt, bt, _t(x), _t(y))
    loss.backward()
    return (float(loss.detach()), [w.grad.numpy() for w in Wt],
            [None if v is None else v.grad.numpy() for v in bt])
