"""A catalogue of layouts people write, each with the chains discovery must claim.

Every entry is ``(factory, input shape, expected chains, expected PSI layers)`` (a shape
starting with ``"tokens"`` asks for integer token ids); chains are
lists of module names in order. Written by hand after torchvision's and common tutorials'
models (torchvision is no dependency), small enough for float64 checks on a CPU.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def seq(*layers):
    return nn.Sequential(*layers)


class PerTokenFlatten(nn.Module):
    """Seen in use: a Linear per token on (batch, tokens, features), then a flatten (token-major)
    into a Linear. fc0 -> fc1 is a chain (both per token); fc1 -> head is not."""

    def __init__(self):
        super().__init__()
        self.fc0, self.fc1, self.head = nn.Linear(5, 6), nn.Linear(6, 4), nn.Linear(3 * 4, 3)

    def forward(self, x):
        h = F.relu(self.fc1(F.relu(self.fc0(x))))
        return self.head(torch.flatten(h, 1))


class Maxout(nn.Module):
    """Seen in use: MaxPool1d(2) over the feature axis of a 2-D activation (maxout)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.pool, self.fc2 = nn.Linear(6, 8), nn.MaxPool1d(2), nn.Linear(4, 3)

    def forward(self, x):
        return self.fc2(self.pool(self.fc1(x)))


class SharedWeight(nn.Module):
    """Seen in use: one weight Parameter shared by two Linear modules."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 3)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.c(F.relu(self.b(F.relu(self.a(x)))))


class TiedHead(nn.Module):
    """Seen in use: a Linear head whose weight is tied to an Embedding."""

    def __init__(self, vocab=7, dim=5):
        super().__init__()
        self.emb, self.fc = nn.Embedding(vocab, dim), nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):  # (batch, tokens) integer ids
        return self.head(F.relu(self.fc(self.emb(tokens).mean(1))))


class TiedToUnused(nn.Module):
    """A head tied to an Embedding that forward() does not call (used by another method):
    G-SGD on the head would write the embedding behind the user's back."""

    def __init__(self, vocab=7, dim=5):
        super().__init__()
        self.emb, self.fc = nn.Embedding(vocab, dim), nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def encode(self, tokens):
        return self.emb(tokens).mean(1)

    def forward(self, x):
        return self.head(F.relu(self.fc(x)))


class ChannelMaxPool(nn.Module):
    """Seen in use: MaxPool3d((2, 1, 1)) on a 4-D conv output pools over channels."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 6, 3), nn.Conv2d(3, 4, 3)
        self.pool = nn.MaxPool3d((2, 1, 1))

    def forward(self, x):
        return self.c2(self.pool(F.relu(self.c1(x))))


class Twice(nn.Module):
    """A module called twice: no chain through it, and no error."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.c(F.relu(self.b(F.relu(self.a(F.relu(self.a(x)))))))


class Functional(nn.Module):
    """F.* calls: relu, max_pool2d, flatten, view with x.size(0)."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 5, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(5 * 2 * 2, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.c1(x)), 2)
        h = F.max_pool2d(torch.relu(self.c2(h)), 2)
        h = h.view(h.size(0), -1)
        return self.fc2(self.fc1(h).clamp(min=0))


class ChannelsLastPerPixel(nn.Module):
    """A conv, a permute to channels-last, then Linears per pixel over channels."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc1, self.fc2 = nn.Conv2d(3, 4, 3), nn.Linear(4, 6), nn.Linear(6, 2)

    def forward(self, x):
        h = F.relu(self.conv(x)).permute(0, 2, 3, 1)
        return self.fc2(F.relu(self.fc1(h)))


class Residual(nn.Module):
    """A residual block without norms: conv1 -> relu -> conv2 is a chain inside the branch."""

    def __init__(self, c=4):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.conv1, self.conv2 = nn.Conv2d(c, 6, 3, padding=1), nn.Conv2d(6, c, 3, padding=1)
        self.head = nn.Linear(c, 3)

    def forward(self, x):
        x = F.relu(self.stem(x))
        x = F.relu(x + self.conv2(F.relu(self.conv1(x))))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class BasicBlock(nn.Module):
    """ResNet's basic block with batch norm: every conv is PSI, no chains."""

    def __init__(self, c=4):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class Attention(nn.Module):
    """An attention block then a per-token ReLU MLP: only the MLP is a chain."""

    def __init__(self, d=6):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.mlp1, self.mlp2 = nn.Linear(d, 8), nn.Linear(8, d)

    def forward(self, x):
        att = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2) / 6 ** 0.5, dim=-1)
        x = x + self.o(att @ self.v(x))
        return x + self.mlp2(F.relu(self.mlp1(x)))


def feature_pool_same_width():
    """Max-pooling over features with stride 1 keeps the width: only the layout rule tells
    that it mixes units."""
    return seq(nn.Linear(6, 8), nn.ReLU(), nn.MaxPool1d(3, stride=1, padding=1),
               nn.Linear(8, 3))


def channel_pool_same_width():
    return seq(nn.Conv2d(3, 6, 3), nn.ReLU(),
               nn.MaxPool3d((3, 1, 1), stride=1, padding=(1, 0, 0)), nn.Conv2d(6, 4, 3))


def lenet5():
    return seq(nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(),
               nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 4 * 4, 12), nn.ReLU(),
               nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 10))


def vgg_small():
    return seq(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
               nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
               nn.Conv2d(6, 6, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(3), nn.Flatten(),
               nn.Linear(6 * 9, 8), nn.ReLU(), nn.Dropout(), nn.Linear(8, 3))


def alexnet_small():
    return seq(nn.Conv2d(3, 4, 5, stride=2, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
               nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2),
               nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Dropout(), nn.Linear(6 * 4, 8),
               nn.ReLU(), nn.Dropout(), nn.Linear(8, 3))


def vgg_channels_last():
    return vgg_small().to(memory_format=torch.channels_last)


def grouped():
    return seq(nn.Conv2d(4, 4, 3, groups=2), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.ReLU(),
               nn.Conv2d(4, 2, 1))


def depthwise_bn():
    return seq(nn.Conv2d(4, 4, 3, groups=4, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
               nn.Conv2d(4, 6, 1), nn.BatchNorm2d(6), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
               nn.Flatten(), nn.Linear(6, 3))


def activations():
    return seq(nn.Conv2d(2, 4, 3), nn.PReLU(4), nn.Conv2d(4, 5, 3), nn.LeakyReLU(0.1),
               nn.Conv2d(5, 3, 1), nn.ReLU6(), nn.Conv2d(3, 2, 1))


def gelu_mlp():
    return seq(nn.Linear(5, 8), nn.GELU(), nn.Linear(8, 3))


def conv1d_stack():
    return seq(nn.Conv1d(2, 4, 3), nn.ReLU(), nn.MaxPool1d(2), nn.Conv1d(4, 5, 3), nn.ReLU(),
               nn.AdaptiveMaxPool1d(2), nn.Flatten(), nn.Linear(10, 3))


def linear_bn():
    return seq(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 6), nn.ReLU(),
               nn.Linear(6, 3))


def linear_ln():
    return seq(nn.Linear(5, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3))


def linear_flatten_linear():
    return seq(nn.Linear(5, 6), nn.ReLU(), nn.Flatten(), nn.Linear(6, 3))


def conv_then_linear_on_width():
    return seq(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Linear(4, 3))


def frozen_backbone():
    model = vgg_small()
    for m in list(model)[:6]:
        for p in m.parameters():
            p.requires_grad_(False)
    return model


def mlp_dropout():
    return seq(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 8), nn.ReLU(),
               nn.Dropout(0.2), nn.Linear(8, 3))


def conv3d_stack():
    return seq(nn.Conv3d(2, 3, 3, padding=1), nn.ReLU(), nn.MaxPool3d(2), nn.AvgPool3d(1),
               nn.Conv3d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool3d(2),
               nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(4, 3))


def conv1d_avg():
    return seq(nn.Conv1d(2, 4, 3), nn.ReLU(), nn.AvgPool1d(2), nn.Conv1d(4, 5, 3), nn.ReLU(),
               nn.AdaptiveAvgPool1d(2), nn.Flatten(), nn.Linear(10, 3))


class FunctionalPools(nn.Module):
    """F.* pools of every kind (max, average, adaptive max and average) on ``ConvNd``
    outputs, ``N`` = 1 (a signal) or 3 (a volume)."""

    def __init__(self, n: int):
        super().__init__()
        conv = {1: nn.Conv1d, 3: nn.Conv3d}[n]
        self.c1, self.c2 = conv(2, 3, 3, padding=1), conv(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)
        self.pools = [getattr(F, f"{kind}_pool{n}d")
                      for kind in ("max", "avg", "adaptive_max", "adaptive_avg")]

    def forward(self, x):
        max_pool, avg_pool, adaptive_max, adaptive_avg = self.pools
        h = avg_pool(max_pool(F.relu(self.c1(x)), 2), 1)
        h = adaptive_avg(adaptive_max(F.relu(self.c2(h)), 2), 1)
        return self.fc(torch.flatten(h, 1))


class Functional2d(nn.Module):
    """F.* 2-d average and adaptive pools, then AdaptiveMaxPool2d and AdaptiveAvgPool2d,
    on Conv2d outputs."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 4, 3, padding=1)
        self.maxpool, self.pool = nn.AdaptiveMaxPool2d(2), nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = F.adaptive_max_pool2d(F.avg_pool2d(F.relu(self.c1(x)), 2), 3)
        h = self.pool(self.maxpool(F.adaptive_avg_pool2d(F.relu(self.c2(h)), 2)))
        return self.fc(torch.flatten(h, 1))


class ClampSix(nn.Module):
    """``clamp(0, 6)`` (ReLU6 written as a clamp) is not positively homogeneous."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(self.fc1(x).clamp(0, 6))


class MethodStyle(nn.Module):
    """Tensor methods where tutorials use F.*: ``x.relu()``, then ``x.flatten(1)`` or
    ``x.reshape(x.shape[0], -1)`` (``flatten``: which)."""

    def __init__(self, flatten: str):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 4, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(4 * 2 * 2, 6), nn.Linear(6, 3)
        self.flatten = flatten

    def forward(self, x):
        h = F.max_pool2d(self.c1(x).relu(), 2)
        h = F.max_pool2d(self.c2(h).relu(), 2)
        h = h.flatten(1) if self.flatten == "flatten" else h.reshape(h.shape[0], -1)
        return self.fc2(self.fc1(h).relu())


def group_norms():
    """GroupNorm with a group per channel normalises each unit (PSI); with two groups of
    channels it does not (SGD's rule, no chain through it)."""
    return seq(nn.Conv2d(2, 4, 3), nn.GroupNorm(4, 4), nn.ReLU(), nn.Conv2d(4, 4, 3),
               nn.GroupNorm(2, 4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
               nn.Linear(4, 3))


class TiedAutoencoder(nn.Module):
    """An autoencoder whose decoder is the encoder's transpose, ``F.linear(z,
    enc2.weight.t())``: enc2's weight is read outside its own call."""

    def __init__(self):
        super().__init__()
        self.enc1, self.enc2 = nn.Linear(8, 6), nn.Linear(6, 4)

    def forward(self, x):
        z = self.enc2(self.enc1(x).relu()).relu()
        return F.linear(z, self.enc2.weight.t())


class PatchTokens(nn.Module):
    """A ViT-style patch embedding, ``conv(x).flatten(2).transpose(1, 2)`` (a partial
    flatten: tokens of channels), then a ReLU MLP per token."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 4, 2, stride=2)
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = self.patch(x).flatten(2).transpose(1, 2)
        return self.fc2(F.relu(self.fc1(h)))


class TokenMixer(nn.Module):
    """MLP-Mixer's token mixing: ``conv(x).flatten(2)`` (a partial flatten: channels of
    tokens), then Linears over the tokens of each channel."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 3, 2, stride=2)
        self.fc1, self.fc2 = nn.Linear(9, 8), nn.Linear(8, 9)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(self.patch(x).flatten(2))))

class NamedEnd(nn.Module):
    """A full flatten of a Conv2d output with its last axis named: ``torch.flatten(x, 1,
    3)``, ``x.flatten(1, 3)`` or ``nn.Flatten(1, 3)`` (``how``: which)."""

    def __init__(self, how: str):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 4, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(4 * 2 * 2, 6), nn.Linear(6, 3)
        self.how, self.flat = how, nn.Flatten(1, 3)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.c1(x)), 2)
        h = F.max_pool2d(F.relu(self.c2(h)), 2)
        h = {"torch.flatten": lambda: torch.flatten(h, 1, 3), "method": lambda: h.flatten(1, 3),
             "module": lambda: self.flat(h)}[self.how]()
        return self.fc2(F.relu(self.fc1(h)))


class PartialFlatten(nn.Module):
    """``torch.flatten(x, 1, 2)`` of a Conv2d output (channels and rows merged), then
    Linears over its width: the units of the Linear's input are columns, not channels,
    though its width (4) is a multiple of the channels (2)."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 2, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = F.relu(self.c2(F.relu(self.c1(x))))
        return self.fc2(F.relu(self.fc1(torch.flatten(h, 1, 2))))


class TutorialNet(nn.Module):
    """The classic PyTorch tutorial's CIFAR-10 net: ``x.view(-1, 16 * 5 * 5)``. The batch
    axis is inferred, so the view flattens from axis 1 only if each sample has exactly
    400 values, which the graph cannot tell: two chains, split there."""

    def __init__(self):
        super().__init__()
        self.conv1, self.pool = nn.Conv2d(3, 6, 5), nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1, self.fc2 = nn.Linear(16 * 5 * 5, 120), nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class Aliased(nn.Module):
    """One module under two names (``self.head = self.fc2``, a habit for API names): no
    weight is tied."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)
        self.head = self.fc2

    def forward(self, x):
        return self.head(F.relu(self.fc1(x)))


class Between(nn.Module):
    """``second(op(first(x)))``: one operation, written in forward() as people write it,
    between two weight layers."""

    def __init__(self, first, op, second):
        super().__init__()
        self.first, self.second, self.op = first, second, op

    def forward(self, x):
        return self.second(self.op(self.first(x)))


def conv_between(op, fan_in, out=3):
    """A Conv2d(2, 3, 3) (a (2, 2, 6, 6) input gives (2, 3, 4, 4)), ``op``, a Linear."""
    return Between(nn.Conv2d(2, 3, 3), op, nn.Linear(fan_in, out))


def clamps():
    """ReLU written as clamps in four ways: ``torch.clamp(x, 0)``, ``x.clamp_min(0)``,
    ``torch.clamp(x, min=0)``, ``x.clamp(0)``."""
    ops = (lambda h: torch.clamp(h, 0), lambda h: h.clamp_min(0),
           lambda h: torch.clamp(h, min=0), lambda h: h.clamp(0))

    class Clamps(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.ModuleList(nn.Linear(5, 5) for _ in range(5))

        def forward(self, x):
            for layer, op in zip(self.fc, ops):
                x = op(layer(x))
            return self.fc[4](x)
    return Clamps()


class Checked(nn.Module):
    """``torch._assert(h.dim() == 2, ...)`` reads only the shape of a layer's output."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = self.fc1(x).relu()
        torch._assert(h.dim() == 2, "a batch of vectors")
        return self.fc2(h)


class Unused(nn.Module):
    """A layer whose output forward() computes and drops."""

    def __init__(self):
        super().__init__()
        self.fc1, self.aux, self.fc2 = nn.Linear(5, 6), nn.Linear(5, 2), nn.Linear(6, 3)

    def forward(self, x):
        self.aux(x)
        return self.fc2(F.relu(self.fc1(x)))


class NestedTied(nn.Module):
    """The tied autoencoder inside a block: ``F.linear(z, self.block.enc.weight.t())``."""

    def __init__(self):
        super().__init__()
        self.block = nn.Module()
        self.block.enc = nn.Linear(8, 4)
        self.fc = nn.Linear(6, 8)

    def forward(self, x):
        z = self.block.enc(F.relu(self.fc(x))).relu()
        return F.linear(z, self.block.enc.weight.t())


class SharedThreeWays(nn.Module):
    """One weight shared by three Linear modules."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 5)
        self.b.weight = self.c.weight = self.a.weight

    def forward(self, x):
        return self.c(F.relu(self.b(F.relu(self.a(x)))))


class MethodNamedLikeModule(nn.Module):
    """A submodule named ``relu`` that is a batch norm, and a call of the tensor method
    ``x.relu()``: the method is ReLU, whatever the submodule of that name is."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.relu = nn.Linear(5, 6), nn.Linear(6, 3), nn.BatchNorm1d(3)

    def forward(self, x):
        return self.relu(self.fc2(self.fc1(x).relu()))


def frozen_then_gelu():
    """A frozen layer, GELU, a trainable layer: the frozen layer's own reason is the one
    given, not what stops its walk."""
    model = seq(nn.Linear(5, 6), nn.GELU(), nn.Linear(6, 3))
    model[0].requires_grad_(False)
    return model


def parametrised(wrap):
    """A Linear whose weight a parametrisation or hook computes, between two Linears."""
    return lambda: seq(nn.Linear(4, 5), nn.ReLU(), wrap(nn.Linear(5, 6)), nn.ReLU(),
                       nn.Linear(6, 3))


def qat_conv():
    """QAT's fake-quantised Conv2d (a subclass of nn.Conv2d with a forward of its own)
    between plain convs; its fake quantisation is no positive per-unit map."""
    from torch.ao.nn.qat import Conv2d
    from torch.ao.quantization import get_default_qat_qconfig
    return seq(nn.Conv2d(2, 3, 3), nn.ReLU(),
               Conv2d(3, 4, 1, qconfig=get_default_qat_qconfig()), nn.ReLU(),
               nn.Conv2d(4, 2, 1))


def plain_subclass():
    """``NonDynamicallyQuantizableLinear`` (attention's output projection) subclasses
    Linear without a forward of its own: it is a Linear."""
    return seq(nn.Linear(4, 5), nn.ReLU(), nn.modules.linear.NonDynamicallyQuantizableLinear(
        5, 6), nn.ReLU(), nn.Linear(6, 3))



class NamedRelu(nn.Module):
    """A GELU kept under the name ``relu`` (the activation swapped, the name not): a module is
    what it is, whatever the tensor method of its name is."""

    def __init__(self):
        super().__init__()
        self.fc1, self.relu, self.fc2 = nn.Linear(5, 6), nn.GELU(), nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))


def gelu_then_view(h):
    """GELU, then ``view(h.size(0), -1)``: the GELU's output is also read for its shape."""
    h = F.gelu(h)
    return h.view(h.size(0), -1)


class TanhThen(nn.Module):
    """``op(tanh(x), *args)``: a module called with the arguments of the tensor method ``op``."""

    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x, *args):
        return self.op(torch.tanh(x), *args)


class CalledLikeMethod(nn.Module):
    """A submodule named like a tensor method (``flatten``, ``view``, ``clamp``) and called
    with that method's arguments, ``self.flatten(h, 1)``: an ``nn.DataParallel`` (as PyTorch's
    ImageNet example wraps ``features``; a leaf to fx), here of ``method(tanh(h), *args)``,
    which no name makes a flatten or a ReLU. Kept on the CPU, as on a machine without GPUs."""

    def __init__(self, name, first, args, second):
        super().__init__()
        self.first, self.second, self.method, self.args = first, second, name, args
        wrapped = nn.DataParallel(TanhThen(getattr(torch.Tensor, name)))
        wrapped.device_ids = []
        setattr(self, name, wrapped)

    def forward(self, x):
        return self.second(getattr(self, self.method)(self.first(x), *self.args))


class SizeHead(nn.Module):
    """Seen in use (CenterNet's heads): a trunk feeding two heads, one of them named
    ``size``, as the tensor method is: a layer, not a read of the trunk's shape."""

    def __init__(self):
        super().__init__()
        self.fc, self.heat, self.size = nn.Linear(5, 6), nn.Linear(6, 2), nn.Linear(6, 2)

    def forward(self, x):
        h = F.relu(self.fc(x))
        return self.heat(h), self.size(h)


def squash(module, args):
    """A forward pre-hook squashing a block's input into (-1, 1)."""
    return (torch.tanh(args[0]),)


class ReluBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return F.relu(self.fc(x))


def pre_hooked_block():
    """A block of the user's own (traced through) with a forward pre-hook: the hook is part
    of what the model computes, and its tanh ends the chain before the block."""
    model = seq(nn.Linear(5, 6), nn.ReLU(), ReluBlock(), nn.Linear(6, 3))
    model[2].register_forward_pre_hook(squash)
    return model


# name: (factory, input shape, expected chains, expected PSI layers)
CATALOGUE = {
    "mlp with dropout": (mlp_dropout, (4, 6), [["0", "3", "6"]], []),
    "per-token Linear then flatten": (PerTokenFlatten, (4, 3, 5), [["fc0", "fc1"]], []),
    "maxout (MaxPool1d over features)": (Maxout, (4, 6), [], []),
    "weight shared by two Linears": (SharedWeight, (4, 5), [], []),
    "head tied to an Embedding": (TiedHead, ("tokens", 4, 3), [], []),
    "head tied to an Embedding forward() does not call": (TiedToUnused, (4, 5), [], []),
    "channel max-pool (MaxPool3d((2,1,1)))": (ChannelMaxPool, (2, 3, 7, 7), [], []),
    "module called twice": (Twice, (4, 4), [["b", "c"]], []),
    "feature max-pool keeping the width": (feature_pool_same_width, (4, 6), [], []),
    "channel max-pool keeping the channels": (channel_pool_same_width, (2, 3, 7, 7), [], []),
    "LeNet-5": (lenet5, (2, 1, 28, 28), [["0", "3", "7", "9", "11"]], []),
    "VGG-style with adaptive pool and dropout": (vgg_small, (2, 3, 12, 12),
                                                 [["0", "3", "6", "10", "13"]], []),
    "AlexNet-style": (alexnet_small, (2, 3, 23, 23), [["0", "3", "9", "12"]], []),
    "VGG-style in channels_last memory": (vgg_channels_last, (2, 3, 12, 12),
                                          [["0", "3", "6", "10", "13"]], []),
    "F.* calls and view(x.size(0), -1)": (Functional, (2, 2, 8, 8),
                                          [["c1", "c2", "fc1", "fc2"]], []),
    "channels-last permute then per-pixel Linears": (ChannelsLastPerPixel, (2, 3, 6, 6),
                                                     [["fc1", "fc2"]], []),
    "grouped conv": (grouped, (2, 4, 7, 7), [["2", "4"]], []),
    "depthwise conv + BN": (depthwise_bn, (4, 4, 6, 6), [], ["0", "3"]),
    "residual block without norms": (Residual, (2, 3, 6, 6), [["conv1", "conv2"]], []),
    "ResNet basic block with BN": (BasicBlock, (4, 4, 6, 6), [], ["conv1", "conv2"]),
    "attention block + ReLU MLP": (Attention, (2, 3, 6), [["mlp1", "mlp2"]], []),
    "PReLU, LeakyReLU, ReLU6": (activations, (2, 2, 9, 9), [["0", "2", "4"]], []),
    "GELU MLP": (gelu_mlp, (4, 5), [], []),
    "Conv1d stack with 1-d pooling": (conv1d_stack, (2, 2, 16), [["0", "3", "7"]], []),
    "Conv1d stack with 1-d average pooling": (conv1d_avg, (2, 2, 16), [["0", "3", "7"]], []),
    "Conv3d stack with 3-d pooling": (conv3d_stack, (2, 2, 4, 4, 4), [["0", "4", "9"]], []),
    "F.* 1-d pools": (lambda: FunctionalPools(1), (2, 2, 16), [["c1", "c2", "fc"]], []),
    "F.* 3-d pools": (lambda: FunctionalPools(3), (2, 2, 4, 4, 4), [["c1", "c2", "fc"]], []),
    "F.* 2-d pools, AdaptiveMax/AvgPool2d": (Functional2d, (2, 2, 8, 8),
                                            [["c1", "c2", "fc"]], []),
    "clamp(0, 6) between Linears": (ClampSix, (4, 5), [], []),
    "Linear + BatchNorm1d": (linear_bn, (6, 5), [["3", "5"]], ["0"]),
    "Linear + LayerNorm": (linear_ln, (6, 5), [], []),
    "flatten between Linears (layout unknown)": (linear_flatten_linear, (4, 5), [], []),
    "Linear on a conv's width axis": (conv_then_linear_on_width, (2, 2, 6, 6), [], []),
    "frozen conv backbone, trainable head": (frozen_backbone, (2, 3, 12, 12),
                                             [["6", "10", "13"]], []),
    "x.relu() and x.flatten(1)": (lambda: MethodStyle("flatten"), (2, 2, 8, 8),
                                  [["c1", "c2", "fc1", "fc2"]], []),
    "x.relu() and x.reshape(x.shape[0], -1)": (lambda: MethodStyle("reshape"), (2, 2, 8, 8),
                                               [["c1", "c2", "fc1", "fc2"]], []),
    "GroupNorm per channel (PSI) and in two groups": (group_norms, (2, 2, 8, 8), [], ["0"]),
    "tied autoencoder (decoder = encoder transposed)": (TiedAutoencoder, (4, 8), [], []),
    "ViT-style patch tokens, MLP per token": (PatchTokens, (2, 3, 6, 6), [["fc1", "fc2"]], []),
    "one module under two names": (Aliased, (4, 5), [["fc1", "fc2"]], []),
    "MLP-Mixer token mixing after flatten(2)": (TokenMixer, (2, 3, 6, 6), [["fc1", "fc2"]],
                                                []),
    "torch.flatten(x, 1, 3)": (lambda: NamedEnd("torch.flatten"), (2, 2, 8, 8),
                               [["c1", "c2", "fc1", "fc2"]], []),
    "x.flatten(1, 3)": (lambda: NamedEnd("method"), (2, 2, 8, 8),
                        [["c1", "c2", "fc1", "fc2"]], []),
    "nn.Flatten(1, 3)": (lambda: NamedEnd("module"), (2, 2, 8, 8),
                         [["c1", "c2", "fc1", "fc2"]], []),
    "partial flatten(1, 2) of a Conv2d output": (PartialFlatten, (2, 2, 3, 4),
                                                 [["c1", "c2"], ["fc1", "fc2"]], []),
    "tutorial net, x.view(-1, 16 * 5 * 5)": (TutorialNet, (2, 3, 32, 32),
                                             [["conv1", "conv2"], ["fc1", "fc2", "fc3"]], []),
    "torch.flatten(x, start_dim=1)": (
        lambda: conv_between(lambda h: torch.flatten(h.relu(), start_dim=1), 48),
        (2, 2, 6, 6), [["first", "second"]], []),
    "torch.flatten(x, start_dim=1, end_dim=2) then a Linear per row": (
        lambda: conv_between(lambda h: torch.flatten(h, start_dim=1, end_dim=2), 4),
        (2, 2, 6, 6), [], []),
    "torch.flatten(x) (the batch axis too)": (
        lambda: conv_between(lambda h: torch.flatten(h), 96), (2, 2, 6, 6), [], []),
    "x.view((x.size(0), -1))": (
        lambda: conv_between(lambda h: h.relu().view((h.size(0), -1)), 48),
        (2, 2, 6, 6), [["first", "second"]], []),
    "x.view(-1) into an unbatched Linear": (
        lambda: conv_between(lambda h: h.view(-1), 96), (2, 2, 6, 6), [], []),
    "torch.transpose(x, 1, -1) then a Linear per pixel": (
        lambda: conv_between(lambda h: torch.transpose(h, 1, -1), 3), (2, 2, 6, 6), [], []),
    "x.transpose(1, -1) then a Linear per pixel": (
        lambda: conv_between(lambda h: h.transpose(1, -1), 3), (2, 2, 6, 6), [], []),
    "nn.Flatten(2) then a Linear per channel": (
        lambda: conv_between(nn.Flatten(2), 16), (2, 2, 6, 6), [], []),
    "flatten then MaxPool1d": (
        lambda: conv_between(nn.Sequential(nn.Flatten(), nn.MaxPool1d(2)), 24),
        (2, 2, 6, 6), [], []),
    "ReLU as clamps": (clamps, (4, 5), [["fc.0", "fc.1", "fc.2", "fc.3", "fc.4"]], []),
    "x.clamp(min=0, max=6)": (
        lambda: Between(nn.Linear(5, 6), lambda h: h.clamp(min=0, max=6), nn.Linear(6, 3)),
        (4, 5), [], []),
    "torch._assert on x.dim()": (Checked, (4, 5), [["fc1", "fc2"]], []),
    "a layer whose output is unused": (Unused, (4, 5), [["fc1", "fc2"]], []),
    "tied autoencoder inside a block": (NestedTied, (4, 6), [], []),
    "weight shared by three Linears": (SharedThreeWays, (4, 5), [], []),
    "a submodule named like a tensor method": (MethodNamedLikeModule, (4, 5),
                                               [["fc1", "fc2"]], []),
    "F.max_pool1d over a Linear's units": (
        lambda: Between(nn.Linear(5, 6), lambda h: F.max_pool1d(h, 2), nn.Linear(3, 3)),
        (4, 5), [], []),
    "frozen layer, GELU, trainable layer": (frozen_then_gelu, (4, 5), [], []),
    "weight_norm (parametrisation)": (parametrised(nn.utils.parametrizations.weight_norm),
                                      (4, 4), [], []),
    "spectral_norm (parametrisation)": (parametrised(nn.utils.parametrizations.spectral_norm),
                                        (4, 4), [], []),
    "weight_norm (hook)": (parametrised(nn.utils.weight_norm), (4, 4), [], []),
    "NonDynamicallyQuantizableLinear": (plain_subclass, (4, 4), [["0", "2", "4"]], []),
    "nn.Flatten(1, 2) of a Conv2d output then a Linear per row": (
        lambda: conv_between(nn.Flatten(1, 2), 6), (2, 2, 8, 8), [], []),
    # a shape given by keyword is not read: refused, never guessed
    "x.reshape(shape=(x.size(0), -1))": (
        lambda: conv_between(lambda h: h.reshape(shape=(h.size(0), -1)), 48),
        (2, 2, 6, 6), [], []),
    "x.clamp(min=0.1) (a shifted ReLU)": (
        lambda: Between(nn.Linear(5, 6), lambda h: h.clamp(min=0.1), nn.Linear(6, 3)),
        (4, 5), [], []),
    "a GELU submodule named relu": (NamedRelu, (4, 5), [], []),
    "GELU, then a view read for its size": (lambda: conv_between(gelu_then_view, 48),
                                            (2, 2, 6, 6), [], []),
    "a submodule named flatten called as self.flatten(x, 1)": (
        lambda: CalledLikeMethod("flatten", nn.Conv2d(2, 3, 3), (1,), nn.Linear(48, 3)),
        (2, 2, 6, 6), [], []),
    "a submodule named view called as self.view(x, 2, -1)": (
        lambda: CalledLikeMethod("view", nn.Conv2d(2, 3, 3), (2, -1), nn.Linear(48, 3)),
        (2, 2, 6, 6), [], []),
    "a submodule named clamp called as self.clamp(x, 0)": (
        lambda: CalledLikeMethod("clamp", nn.Linear(5, 6), (0,), nn.Linear(6, 3)),
        (4, 5), [], []),
    "BatchNorm1d after the ReLU": (
        lambda: seq(nn.Linear(5, 8), nn.ReLU(), nn.BatchNorm1d(8), nn.Linear(8, 3)), (6, 5),
        [], []),
    "a trunk and two heads, one named size": (SizeHead, (4, 5), [], []),
    "a block with a forward pre-hook": (pre_hooked_block, (4, 5), [["2.fc", "3"]], []),
}

# The unsound claims that shapes alone cannot rule out: forced by hand, a
# random rescaling changes the output. (Maxout's and the channel max-pool's layers do not
# even have the shapes of a chain: chain_of refuses them.)
UNSOUND = {
    "per-token Linear then flatten": ["fc1", "head"],
    "feature max-pool keeping the width": ["0", "3"],
    "channel max-pool keeping the channels": ["0", "3"],
    "weight shared by two Linears": ["a", "b", "c"],
    "head tied to an Embedding": ["fc", "head"],
    "Linear + LayerNorm": ["0", "3"],
    "tied autoencoder (decoder = encoder transposed)": ["enc1", "enc2"],
    "partial flatten(1, 2) of a Conv2d output": ["c2", "fc1"],
    "nn.Flatten(1, 2) of a Conv2d output then a Linear per row": ["first", "second"],
    "x.clamp(min=0.1) (a shifted ReLU)": ["first", "second"],
    "a GELU submodule named relu": ["fc1", "fc2"],
    "a submodule named flatten called as self.flatten(x, 1)": ["first", "second"],
    "a submodule named view called as self.view(x, 2, -1)": ["first", "second"],
    "a submodule named clamp called as self.clamp(x, 0)": ["first", "second"],
    "a block with a forward pre-hook": ["0", "2.fc", "3"],
}

# Why discover() leaves each layer of a catalogue entry out of every chain, whole (an entry
# not listed has none): the reasons a user reads in describe() and in strict's error.
END = "its output is the model's output"
FLATTEN_LINEAR = ("the flatten of a Linear output may not be channel-major (a Linear applied "
                  "per token, then flattened, is token-major)")
TIED = "its parameters are also read outside the module (e.g. F.linear)"
FROZEN = "frozen (requires_grad=False, or in no param group)"
COMPUTED = ("its weight is computed from other tensors (weight_norm, spectral_norm or another "
            "parametrisation), not a parameter of its own")
MIXED = "which normalises several units together: a row is not scale-invariant on its own " \
        "(no PSI either)"


def goes(op):
    return f"its output goes to {op}, which is not positively homogeneous per unit"


def pools(pool, layout):
    return f"{pool} pools over the unit axis of a {layout} output (it mixes units)"


def shared(*others):
    return f"a parameter is shared with {', '.join(others)} (tied weights)"


def after(layer, why, then=END):
    """The reason of the layer after ``layer``: what stopped ``layer``'s walk, then its own."""
    return f"after {layer}: {why}; {then}"


def stopped_at(why, first="first", second="second"):
    """Both layers of a :func:`conv_between` (or :class:`Between`) stopped by ``why``."""
    return {first: why, second: after(first, why)}


def computed():
    return {"2": COMPUTED, "0": "the next layer 2 cannot be in a chain", "4": END}


REASONS = {
    "per-token Linear then flatten": {"head": after("fc1", FLATTEN_LINEAR)},
    "maxout (MaxPool1d over features)": stopped_at(pools("MaxPool1d", "Linear"), "fc1", "fc2"),
    "weight shared by two Linears": {"a": shared("b"), "b": shared("a"), "c": END},
    "head tied to an Embedding": {"head": shared("emb"),
                                  "fc": "the next layer head cannot be in a chain"},
    "head tied to an Embedding forward() does not call": {
        "head": shared("emb"), "fc": "the next layer head cannot be in a chain"},
    "channel max-pool (MaxPool3d((2,1,1)))": stopped_at(pools("MaxPool3d", "Conv2d"),
                                                        "c1", "c2"),
    "module called twice": {"a": "the module is called 2 times in forward()"},
    "feature max-pool keeping the width": stopped_at(pools("MaxPool1d", "Linear"), "0", "3"),
    "channel max-pool keeping the channels": stopped_at(pools("MaxPool3d", "Conv2d"),
                                                        "0", "3"),
    "channels-last permute then per-pixel Linears": {"conv": goes("permute")},
    "grouped conv": {"0": "grouped or depthwise convolution (groups=2)"},
    "depthwise conv + BN": {"0": "grouped or depthwise convolution (groups=4)",
                            "3": "followed by BatchNorm2d",
                            "8": after("3", "followed by BatchNorm2d")},
    "residual block without norms": {
        "stem": "its output is used by several operations (a branch or a residual add)",
        "head": END},
    "ResNet basic block with BN": {
        "conv1": "followed by BatchNorm2d",
        "conv2": after("conv1", "followed by BatchNorm2d", "followed by BatchNorm2d")},
    "attention block + ReLU MLP": {
        "q": goes("matmul"), "k": goes("transpose"),
        "v": "its output is not the first input of matmul",
        "o": after("q", goes("matmul"), "its output is not the first input of add")},
    "PReLU, LeakyReLU, ReLU6": {"6": after("4", goes("ReLU6"))},
    "GELU MLP": stopped_at(goes("GELU"), "0", "2"),
    "clamp(0, 6) between Linears": stopped_at(goes("clamp"), "fc1", "fc2"),
    "Linear + BatchNorm1d": {"0": "followed by BatchNorm1d"},
    "Linear + LayerNorm": {"0": f"followed by LayerNorm, {MIXED}",
                           "3": after("0", "followed by LayerNorm")},
    "flatten between Linears (layout unknown)": stopped_at(FLATTEN_LINEAR, "0", "3"),
    "Linear on a conv's width axis": stopped_at(
        "the next layer 2 does not read the units of a Conv2d output", "0", "2"),
    "frozen conv backbone, trainable head": {"0": FROZEN, "3": FROZEN},
    "GroupNorm per channel (PSI) and in two groups": {
        "0": "followed by GroupNorm", "3": f"followed by GroupNorm, {MIXED}",
        "8": after("3", "followed by GroupNorm")},
    "tied autoencoder (decoder = encoder transposed)": {
        "enc2": TIED, "enc1": "the next layer enc2 cannot be in a chain"},
    "ViT-style patch tokens, MLP per token": {"patch": goes("flatten")},
    "MLP-Mixer token mixing after flatten(2)": {"patch": goes("flatten")},
    "torch.flatten(x, start_dim=1, end_dim=2) then a Linear per row": stopped_at(
        goes("flatten")),
    "torch.flatten(x) (the batch axis too)": stopped_at(goes("flatten")),
    "x.view(-1) into an unbatched Linear": stopped_at(goes("view")),
    "torch.transpose(x, 1, -1) then a Linear per pixel": stopped_at(goes("transpose")),
    "x.transpose(1, -1) then a Linear per pixel": stopped_at(goes("transpose")),
    "nn.Flatten(2) then a Linear per channel": stopped_at(goes("Flatten")),
    "flatten then MaxPool1d": stopped_at(pools("MaxPool1d", "flattened")),
    "F.max_pool1d over a Linear's units": stopped_at(pools("max_pool1d", "Linear")),
    "x.clamp(min=0, max=6)": stopped_at(goes("clamp")),
    "a layer whose output is unused": {"aux": "its output is unused"},
    "tied autoencoder inside a block": {"block.enc": TIED,
                                        "fc": "the next layer block.enc cannot be in a chain"},
    "weight shared by three Linears": {"a": shared("b", "c"), "b": shared("a", "c"),
                                       "c": shared("a", "b")},
    "frozen layer, GELU, trainable layer": {"0": FROZEN, "2": END},
    "weight_norm (parametrisation)": computed(),
    "spectral_norm (parametrisation)": computed(),
    "weight_norm (hook)": computed(),
    "nn.Flatten(1, 2) of a Conv2d output then a Linear per row": stopped_at(goes("Flatten")),
    "x.reshape(shape=(x.size(0), -1))": stopped_at(goes("reshape")),
    "x.clamp(min=0.1) (a shifted ReLU)": stopped_at(goes("clamp")),
    "a GELU submodule named relu": stopped_at(goes("GELU"), "fc1", "fc2"),
    "GELU, then a view read for its size": stopped_at(goes("gelu")),
    "a submodule named flatten called as self.flatten(x, 1)": stopped_at(goes("DataParallel")),
    "a submodule named view called as self.view(x, 2, -1)": stopped_at(goes("DataParallel")),
    "a submodule named clamp called as self.clamp(x, 0)": stopped_at(goes("DataParallel")),
    "BatchNorm1d after the ReLU": stopped_at(goes("BatchNorm1d"), "0", "3"),
    "a trunk and two heads, one named size": {
        "fc": "its output is used by several operations (a branch or a residual add)",
        "heat": END, "size": END},
    "a block with a forward pre-hook": {"0": goes("tanh")},
}
