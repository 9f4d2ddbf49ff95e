"""The ghost engine's rules for convolutions: Conv2d, and Conv1d as the same convolution in 2-D.

Example i's weight gradient of a convolution is a sequence Linear's over the output positions
(Goodfellow 2015; Rochette et al. 2019): per group, g_i = b_iᵀ a_i with a_i the input unfolded
[T, d] (T = Ho·Wo positions, d = Cin/groups·kh·kw) and b_i the output gradient [T, p]
(p = Cout/groups). Its norm is formed one of three ways, chosen per layer by cost
(``layers.norm_route``, ``layers.keep_pays``; Bu et al. 2023, "mixed ghost clipping"):

  ghost     ‖g_i‖² = ⟨a_i a_iᵀ, b_i b_iᵀ⟩, two [T, T] Gram matrices: T²(d + p) multiply-adds, cheap
            where the feature map is small (deep layers of a ResNet: T = 1–16);
  explicit  g_i itself (kernel row by kernel row, or a grouped convolution), its norm, discarded:
            T·d·p, cheap where T is large and the layer narrow (a first layer on 3 channels);
  kept      g_i formed once and kept for the clipped sum Σ_i c_i g_i, which then costs no weight
            gradient (where its memory traffic is worth it and fits the budget).

The clipped sum is otherwise book-keeping: the layer's ordinary weight gradient for the rescaled
output gradient c ⊙ b. Augmentation multiplicity K: an example's K rows are K·T positions of one
example (ghost), or their products summed before the norm (explicit).

  Conv1dLayer   the Conv2d rule on the same convolution seen as 2-D: input [B, C, 1, L], kernel
                1 × k, weight [O, C/g, 1, k] (views, no copies).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import (
    CHUNK_BYTES,
    Layer,
    Unsupported,
    accumulate,
    gram_sq,
    group_rows,
    keep_pays,
    matvec_into,
    norm_route,
    repeat_factors,
    sq_rows,
)
from ..registry import register_layer


@register_layer(nn.Conv2d)
class Conv2dLayer(Layer):
    """Conv2d of any stride/padding/dilation/groups/padding_mode, on [B, C, H, W] input (module
    doc): per example and group, a_i is the unfolded input [T, d], b_i the output gradient [T, p].

    Explicit: per-example weight gradients, without a fully unfolded copy of the input (kh·kw times
    its size): for groups = 1 and ≥ 16 input channels, one batched matrix product per kernel row
    on an input unfolded along its width only (see `_row_products`); otherwise one grouped
    weight-gradient convolution with B·groups groups (each example its own group). Kept and reused
    for the clipped sum where that pays (``layers.keep_pays``) and they fit the memory budget;
    otherwise only their norms are formed (kernel row by kernel row, or in chunks).
    Ghost: ⟨a_i a_iᵀ, b_i b_iᵀ⟩ from the unfolded input, a chunk of examples at a time
    (`_ghost_sq_norms`), where ``layers.norm_route`` finds it cheaper. Without kept products the
    clipped sum is the layer's ordinary weight gradient for the rescaled output gradient c ⊙ b
    (book-keeping).
    """

    def __init__(self, module: nn.Conv2d, names):
        super().__init__(module, names)
        m = module
        self.explicit_pad = isinstance(m.padding, str) or m.padding_mode != "zeros"
        self.by_rows = m.groups == 1 and m.in_channels >= 16  # `_row_products`, else grouped conv
        self.padding = [0, 0] if self.explicit_pad else list(m.padding)

    def check_input(self, a):
        if a.dim() != 4:
            raise Unsupported(
                f"{self.label} got input of shape {list(a.shape)}; "
                "the ghost engine needs batched [B, C, H, W] input"
            )

    def prepare(self, a):
        m = self.module
        self.check_input(a)
        if self.explicit_pad:
            mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
            a = F.pad(a, m._reversed_padding_repeated_twice, mode=mode)
        return a

    def _weight_grad(self, a, b, groups_mult: int = 1):
        m = self.module
        w = m.weight
        if groups_mult == 1:
            weight = w
        else:  # shape only; values unused
            weight = w.new_empty((groups_mult * w.shape[0],) + tuple(w.shape[1:]))
        return torch.ops.aten.convolution_backward(
            b,
            a,
            weight,
            None,
            list(m.stride),
            self.padding,
            list(m.dilation),
            False,
            [0, 0],
            m.groups * groups_mult,
            [False, True, False],
        )[1]

    def _per_example(self, a, b):
        """Per-example weight gradients as (G, perm): G.permute(perm)[i] has the weight's shape."""
        m, n = self.module, a.shape[0]
        if self.by_rows:
            return self._per_example_rows(a, b), (0, 1, 4, 2, 3)
        g = self._weight_grad(
            a.reshape((1, -1) + a.shape[2:]), b.reshape((1, -1) + b.shape[2:]), groups_mult=n
        )
        return g.view((n,) + tuple(m.weight.shape)), None

    def _per_example_rows(self, a, b):
        """G[i, o, u, v, c] = Σ_t b[i, o, t] · x[i, c, t·stride + (u, v)·dilation] (groups = 1)."""
        n, cout = b.shape[:2]
        kh, kw = self.module.kernel_size
        G = b.new_empty((n, cout, kh, kw, a.shape[1]))
        for s, u, G_u in self._row_products(a, b):
            G[s : s + G_u.shape[0], :, u] = G_u.view(G_u.shape[0], cout, kw, -1)
        return G

    def _row_products(self, a, b, K: int = 1):
        """Yield (s, u, G_u): examples s.. of one kernel row u, G_u[i, o, (v, c)] = G[i, o, u, v,
        c].

        The input is unfolded along the width only: X[i, h, j, v, c] = x[i, c, h, j·sw + v·dw]
        (kw times the input, formed for CHUNK_BYTES worth of examples at a time). Kernel row u
        then reads the rows h = i·sh + u·dh of X, which for stride 1 are consecutive, so the
        product for all kw offsets of the row is one batched matrix product
        b_i [Cout, Ho·Wo] @ X_i(u) [Ho·Wo, kw·Cin] without another copy. (One product per
        kernel offset on [Ho·Wo, Cin] slices, the earlier scheme, copied each slice first and ran
        ~30 % slower on the CIFAR net's 64-channel convolution.)
        Chunks hold whole examples: a multiple of K rows (augmentation multiplicity).
        """
        m = self.module
        n, _, ho, wo = b.shape
        kh, kw = m.kernel_size
        (sh, sw), (dh, dw) = m.stride, m.dilation
        ph, pw = self.padding
        xp = F.pad(a, (pw, pw, ph, ph)) if ph or pw else a
        xp = xp.permute(0, 2, 3, 1).contiguous()  # [B, Hp, Wp, Cin]
        _, hp, wp, cin = xp.shape
        bf = b.flatten(2)  # [B, Cout, Ho·Wo]
        per_example = hp * wo * kw * cin * xp.element_size()
        step = max(1, CHUNK_BYTES // max(1, per_example) // K) * K
        for s in range(0, n, step):
            x = xp[s : s + step]
            X = x.as_strided(
                (x.shape[0], hp, wo, kw, cin), (hp * wp * cin, wp * cin, sw * cin, dw * cin, 1)
            ).contiguous()
            for u in range(kh):
                rows = X[:, u * dh : u * dh + sh * (ho - 1) + 1 : sh]  # [n, Ho, Wo, kw, Cin]
                yield s, u, torch.bmm(bf[s : s + step], rows.reshape(x.shape[0], ho * wo, kw * cin))

    def _sq_norms_rows(self, a, b, K: int = 1):
        """Σ_u ‖G[:, :, u]‖², one kernel row (and chunk of examples) at a time: nothing kept."""
        sq = torch.zeros(a.shape[0] // K, dtype=b.dtype, device=b.device)
        for s, _, G_u in self._row_products(a, b, K):
            G_u = group_rows(G_u, K)
            sq[s // K : s // K + G_u.shape[0]] += sq_rows(G_u.flatten(1))
        return sq

    def _tdp(self, b, K: int) -> tuple[int, int, int]:
        """(T, d, p) of one example and group: K·Ho·Wo positions, Cin/g·kh·kw, Cout/g."""
        m = self.module
        kh, kw = m.kernel_size
        g = m.groups
        return K * b.shape[2] * b.shape[3], m.in_channels // g * kh * kw, m.out_channels // g

    def kept_bytes(self, a, b, K=1):
        """The per-example products where keeping them pays; on the ghost route the unfolded
        input, kept for the clipped sum as one GEMM (`_unfolded_sum`); else nothing."""
        if "weight" not in self.names:
            return 0
        T, d, p = self._tdp(b, K)
        if keep_pays(T, d, p):
            return a.shape[0] * self.module.weight.numel() * b.element_size()
        if norm_route(T, d, p) == "ghost":
            return a.shape[0] // K * self.module.groups * T * d * a.element_size()
        return 0

    def _ghost_sq_norms(self, a, b, K: int, keep: bool = False):
        """(Σ_groups ⟨a_i a_iᵀ, b_i b_iᵀ⟩ [B], the unfolded input [B·g, K·T, d] when ``keep`` or
        None) with a_i the input unfolded (``F.unfold``: [d, T] per group, channels outermost)
        over the K·T positions of example i, b_i [p, K·T]; a chunk of examples at a time unless
        the unfolded input is kept."""
        m = self.module
        g = m.groups
        T, d, p = self._tdp(b, K)
        n = a.shape[0] // K
        per_example = (g * (d + p) * T + 2 * g * T * T) * a.element_size()
        step = n if keep else max(1, CHUNK_BYTES // per_example)
        sq = torch.empty(n, dtype=b.dtype, device=b.device)
        for s in range(0, n, step):
            rows = slice(s * K, (s + step) * K)
            U = F.unfold(a[rows], m.kernel_size, m.dilation, self.padding, m.stride)
            c = U.shape[0] // K
            A = U.view(c, K, g, d, -1).permute(0, 2, 1, 4, 3).reshape(c * g, T, d)
            Bm = b[rows].reshape(c, K, g, p, -1).permute(0, 2, 1, 4, 3).reshape(c * g, T, p)
            sq[s : s + c] = gram_sq(A, Bm).view(c, g).sum(1)
        return sq, (A if keep else None)

    def _unfolded_sum(self, A, b, f, K: int):
        """Σ_i f_i b_iᵀ a_i from the kept unfolded input A [B·g, K·T, d]: one GEMM per group,
        [p, B·K·T] @ [B·K·T, d], in the weight's layout. (The CPU's convolution_backward is slow
        for feature maps of a few pixels and many channels: 60 ms against 7 ms for resnet18's
        512-channel 3×3 at 1×1, lot 32, one thread; docs/PERFORMANCE.md.)"""
        m = self.module
        g = m.groups
        T, d, p = self._tdp(b, K)
        n = b.shape[0] // K
        Bc = b * repeat_factors(f, K)[:, None, None, None]
        Bc = Bc.reshape(n, K, g, p, -1).permute(2, 3, 0, 1, 4).reshape(g, p, n * T)
        At = A.view(n, g, T, d).transpose(0, 1).reshape(g, n * T, d)
        return torch.bmm(Bc, At).view(m.weight.shape)

    def sq_norms(self, a, b, keep, K=1):
        out, state = {}, None
        if "weight" in self.names:
            if keep and keep_pays(*self._tdp(b, K)):
                G, perm = self._per_example(a, b)
                state = (group_rows(G, K), perm)
                out["weight"] = sq_rows(state[0].flatten(1))
            elif norm_route(*self._tdp(b, K)) == "ghost":
                out["weight"], A = self._ghost_sq_norms(a, b, K, keep)
                state = None if A is None else ("unfolded", A)
            elif self.by_rows:
                out["weight"] = self._sq_norms_rows(a, b, K)
            else:
                step = (
                    max(1, CHUNK_BYTES // (self.module.weight.numel() * a.element_size()) // K) * K
                )
                sq = torch.empty(a.shape[0] // K, dtype=a.dtype, device=a.device)
                for s in range(0, a.shape[0], step):
                    G, _ = self._per_example(a[s : s + step], b[s : s + step])
                    G = group_rows(G, K)
                    sq[s // K : s // K + G.shape[0]] = sq_rows(G.flatten(1))
                out["weight"] = sq
        if "bias" in self.names:
            out["bias"] = sq_rows(group_rows(b.sum((2, 3)), K))
        return out, state

    def clipped_sum(self, a, b, state, factors, own_b=False, out=None, K=1):
        out = out or {}
        grads = {}
        if "bias" in self.names:
            grads["bias"] = matvec_into(
                group_rows(b.sum((2, 3)), K).t(), factors["bias"], out.get("bias")
            )
        if "weight" in self.names:
            if state is not None and isinstance(
                state[0], str
            ):  # one GEMM on the kept unfolded input
                g = self._unfolded_sum(state[1], b, factors["weight"], K)
            elif state is not None:  # reuse: Σ_i c_i G_i
                G, perm = state
                g = torch.tensordot(factors["weight"], G, dims=1)
                g = g if perm is None else g.permute([d - 1 for d in perm[1:]])
            else:  # book-keeping: ∇W for c ⊙ b
                f = repeat_factors(factors["weight"], K)[:, None, None, None]
                g = self._weight_grad(a, b.mul_(f) if own_b else b * f)
            grads["weight"] = accumulate(g, out.get("weight"))
        return grads


class _Conv2dView:
    """A Conv1d as the Conv2d with a 1 × k kernel: the attributes Conv2dLayer reads."""

    def __init__(self, m: nn.Conv1d):
        self.conv1d = m
        self.kernel_size, self.stride = (1, m.kernel_size[0]), (1, m.stride[0])
        self.dilation = (1, m.dilation[0])
        self.padding = m.padding if isinstance(m.padding, str) else (0, m.padding[0])
        self.padding_mode, self.groups = m.padding_mode, m.groups
        self.in_channels, self.out_channels = m.in_channels, m.out_channels
        self._reversed_padding_repeated_twice = [*m._reversed_padding_repeated_twice, 0, 0]

    @property
    def weight(self):
        return self.conv1d.weight.unsqueeze(2)


@register_layer(nn.Conv1d)
class Conv1dLayer(Layer):
    """nn.Conv1d of any stride/padding/dilation/groups/padding_mode, on [B, C, L] (module doc)."""

    def __init__(self, module: nn.Conv1d, names):
        super().__init__(module, names)
        self.as_2d = Conv2dLayer(_Conv2dView(module), names)

    def check_input(self, a):
        if a.dim() != 3:
            raise Unsupported(f"{self.label} got input of shape {list(a.shape)}; needs [B, C, L]")

    def prepare(self, a):
        return self.as_2d.prepare(a.unsqueeze(2))

    def group(self, a, b, K: int):
        return a, b.unsqueeze(2), K

    def kept_bytes(self, a, b, K=1):
        return self.as_2d.kept_bytes(a, b, K)

    def sq_norms(self, a, b, keep, K=1):
        return self.as_2d.sq_norms(a, b, keep, K)

    def clipped_sum(self, a, b, state, factors, own_b=False, out=None, K=1):
        view = {k: (v.unsqueeze(2) if k == "weight" else v) for k, v in (out or {}).items()}
        g = self.as_2d.clipped_sum(a, b, state, factors, own_b, view or None, K)
        if "weight" in g:  # [O, C/g, 1, k] → the parameter's [O, C/g, k] (a view of the same sum)
            g["weight"] = g["weight"].view(self.module.weight.shape)
        return g
