"""Per-layer rules of the ghost engine: per-example squared norms and clipped sums.

Each rule gets a layer's input a and output gradient b (of Σ_i loss_i) for the physical batch:
  LinearLayer  (any input [B, ..., d]): ‖a_i‖²‖b_i‖² on 2-D input; otherwise the ghost Gram form
               ⟨a_i a_iᵀ, b_i b_iᵀ⟩ or the explicit ‖b_iᵀ a_i‖², whichever is cheaper (Bu et al. 2023);
  Conv2dLayer  explicit per-example products without unfolding (see the class);
  GenericLayer any other leaf module with parameters: vmap of the module's vjp (exact, materialises).
Clipped sums are book-keeping: (c ⊙ b)ᵀ a, or the weighted sum of kept per-example products.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vjp, vmap

CHUNK_BYTES = 32 * 2**20             # per-example products formed at once when not kept


class Unsupported(RuntimeError):
    """The model's structure is outside what the ghost engine can handle exactly."""


class _Layer:
    """One parameter-owning module: names of its trainable parameters, by attribute."""

    def __init__(self, module: nn.Module, names: dict[str, str]):
        self.module = module
        self.names = names          # attribute ("weight", "bias", ...) -> full parameter name

    def prepare(self, a: torch.Tensor) -> torch.Tensor:
        return a

    def sq_norms(self, a, b, keep: bool):
        """(dict attr -> [B] squared per-example norms, state reused by `clipped_sum`)."""
        raise NotImplementedError

    def clipped_sum(self, a, b, state, factors: dict[str, torch.Tensor], own_b: bool = False):
        """dict attr -> Σ_i factors[attr]_i g_i(attr).

        own_b: b is a buffer nothing else reads afterwards (contiguous, sharing memory with no
        other layer's a or b), so it may be rescaled in place instead of copied."""
        raise NotImplementedError

    def kept_bytes(self, a, b) -> int:
        """Memory for keeping explicit per-example products (0: nothing worth keeping)."""
        return 0


class LinearLayer(_Layer):
    def sq_norms(self, a, b, keep):
        out = {}
        if a.dim() == 2:                                         # T = 1: ‖a_i‖²‖b_i‖²
            b_sq = _sq(b)
            if "weight" in self.names:
                out["weight"] = _sq(a) * b_sq
            if "bias" in self.names:
                out["bias"] = b_sq
            return out, None
        A, Bm = a.flatten(1, -2), b.flatten(1, -2)               # [B, T, d], [B, T, p]
        state = None
        if "weight" in self.names:
            out["weight"], state = _seq_sq_norms(A, Bm, keep)
        if "bias" in self.names:
            out["bias"] = _sq(Bm.sum(1))
        return out, state

    def kept_bytes(self, a, b):
        if a.dim() == 2 or "weight" not in self.names:
            return 0
        return a.shape[0] * a.shape[-1] * b.shape[-1] * b.element_size()

    def clipped_sum(self, a, b, state, factors, own_b=False):
        grads = {}
        if a.dim() == 2:
            if "bias" in self.names:                             # before b may be rescaled
                grads["bias"] = factors["bias"] @ b
            if "weight" in self.names:                           # (c ⊙ b)ᵀ a: scale the smaller,
                f = factors["weight"][:, None]                   # or b in place (no new buffer)
                if own_b and b.shape[1] <= 2 * a.shape[1]:
                    grads["weight"] = b.mul_(f).t() @ a
                elif b.shape[1] <= a.shape[1]:
                    grads["weight"] = (b * f).t() @ a
                else:
                    grads["weight"] = b.t() @ (a * f)
            return grads
        A, Bm = a.flatten(1, -2), b.flatten(1, -2)
        if "bias" in self.names:
            grads["bias"] = factors["bias"] @ Bm.sum(1)
        if "weight" in self.names:
            if state is not None:                                # reuse explicit b_iᵀ a_i
                grads["weight"] = torch.tensordot(factors["weight"], state, dims=1)
            else:
                f = factors["weight"][:, None, None]
                Bc = Bm.mul_(f) if own_b else Bm * f
                grads["weight"] = Bc.flatten(0, 1).t() @ A.flatten(0, 1)
        return grads


def _seq_sq_norms(A, Bm, keep: bool):
    """‖b_iᵀ a_i‖²_F for A [B, T, d], Bm [B, T, p]; explicit when kept or cheaper, else ghost."""
    T, d, p = A.shape[1], A.shape[2], Bm.shape[2]
    if keep:
        G = Bm.transpose(1, 2) @ A                               # [B, p, d] per-example grads
        return _sq(G.flatten(1)), G
    if T * (d + p) < d * p:                                      # ghost Gram form is cheaper
        return ((A @ A.transpose(1, 2)) * (Bm @ Bm.transpose(1, 2))).sum((1, 2)), None
    sq = torch.empty(A.shape[0], dtype=A.dtype, device=A.device)
    step = max(1, CHUNK_BYTES // max(1, p * d * A.element_size()))
    for s in range(0, A.shape[0], step):                         # explicit, in bounded chunks
        sq[s:s + step] = _sq((Bm[s:s + step].transpose(1, 2) @ A[s:s + step]).flatten(1))
    return sq, None


class Conv2dLayer(_Layer):
    """Conv2d of any stride/padding/dilation/groups/padding_mode, on [B, C, H, W] input.

    Per-example weight gradients, without an unfolded copy of the input (kh·kw times its size):
    for groups = 1 and ≥ 16 input channels, one batched matrix product b_i x_i(u, v)ᵀ per kernel
    offset (u, v) on a channels-last copy of the input; otherwise one grouped weight-gradient
    convolution with B·groups groups (each example its own group). When they fit the memory
    budget they are kept and reused for the clipped sum; otherwise only their norms are formed
    (offset by offset, or in chunks) and the clipped sum is the layer's ordinary weight gradient
    for the rescaled output gradient c ⊙ b (book-keeping).
    """

    def __init__(self, module: nn.Conv2d, names):
        super().__init__(module, names)
        m = module
        self.explicit_pad = isinstance(m.padding, str) or m.padding_mode != "zeros"
        self.padding = [0, 0] if self.explicit_pad else list(m.padding)

    def prepare(self, a):
        m = self.module
        if a.dim() != 4:
            raise Unsupported(f"Conv2d '{self.names}' got input of shape {list(a.shape)}; "
                              "the ghost engine needs batched [B, C, H, W] input")
        if self.explicit_pad:
            mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
            a = F.pad(a, m._reversed_padding_repeated_twice, mode=mode)
        return a

    def _weight_grad(self, a, b, groups_mult: int = 1):
        m = self.module
        w = m.weight
        if groups_mult == 1:
            weight = w
        else:                                                     # shape only; values unused
            weight = w.new_empty((groups_mult * w.shape[0],) + tuple(w.shape[1:]))
        return torch.ops.aten.convolution_backward(
            b, a, weight, None, list(m.stride), self.padding, list(m.dilation), False, [0, 0],
            m.groups * groups_mult, [False, True, False])[1]

    def _per_example(self, a, b):
        """Per-example weight gradients as (G, perm): G.permute(perm)[i] has the weight's shape."""
        m, n = self.module, a.shape[0]
        if m.groups == 1 and m.in_channels >= 16:
            return self._per_example_offsets(a, b), (0, 1, 4, 2, 3)
        g = self._weight_grad(a.reshape((1, -1) + a.shape[2:]), b.reshape((1, -1) + b.shape[2:]),
                              groups_mult=n)
        return g.view((n,) + tuple(m.weight.shape)), None

    def _per_example_offsets(self, a, b):
        """G[i, o, u, v, c] = Σ_t b[i, o, t] · x[i, c, t·stride + (u, v)·dilation] (groups = 1).

        One batched matrix product per kernel offset (u, v) on a channels-last copy of the input:
        no unfolded input (kh·kw times its size) is ever formed.
        """
        n, cout = b.shape[:2]
        G = b.new_empty((n, cout) + tuple(self.module.kernel_size) + (a.shape[1],))
        for (u, v), G_uv in zip(_kernel_offsets(self.module), self._offset_products(a, b)):
            G[:, :, u, v] = G_uv
        return G

    def _offset_products(self, a, b):
        """Yield b_i x_i(u, v)ᵀ, [B, Cout, Cin], for each kernel offset (u, v) in row-major order."""
        m = self.module
        n, cout, ho, wo = b.shape
        (sh, sw), (dh, dw) = m.stride, m.dilation
        ph, pw = self.padding
        xp = F.pad(a, (pw, pw, ph, ph)) if ph or pw else a
        xp = xp.permute(0, 2, 3, 1).contiguous()                    # [B, Hp, Wp, Cin]
        bf = b.flatten(2)                                           # [B, Cout, Ho·Wo]
        for u, v in _kernel_offsets(m):
            xs = xp[:, u * dh: u * dh + sh * (ho - 1) + 1: sh, v * dw: v * dw + sw * (wo - 1) + 1: sw]
            yield torch.bmm(bf, xs.reshape(n, ho * wo, -1))

    def _sq_norms_offsets(self, a, b):
        """Σ_(u,v) ‖G[:, :, u, v, :]‖² one kernel offset at a time: no per-example tensor kept."""
        sq = None
        for G_uv in self._offset_products(a, b):
            part = torch.linalg.vector_norm(G_uv.flatten(1), dim=1).square()
            sq = part if sq is None else sq + part
        return sq

    def kept_bytes(self, a, b):
        if "weight" not in self.names:
            return 0
        return a.shape[0] * self.module.weight.numel() * b.element_size()

    def sq_norms(self, a, b, keep):
        out, state = {}, None
        if "weight" in self.names:
            if keep:
                state = self._per_example(a, b)
                out["weight"] = _sq(state[0].flatten(1))
            elif self.module.groups == 1 and self.module.in_channels >= 16:
                out["weight"] = self._sq_norms_offsets(a, b)
            else:
                step = max(1, CHUNK_BYTES // (self.module.weight.numel() * a.element_size()))
                sq = torch.empty(a.shape[0], dtype=a.dtype, device=a.device)
                for s in range(0, a.shape[0], step):
                    G, _ = self._per_example(a[s:s + step], b[s:s + step])
                    sq[s:s + step] = _sq(G.flatten(1))
                out["weight"] = sq
        if "bias" in self.names:
            out["bias"] = _sq(b.sum((2, 3)))
        return out, state

    def clipped_sum(self, a, b, state, factors, own_b=False):
        grads = {}
        if "bias" in self.names:
            grads["bias"] = factors["bias"] @ b.sum((2, 3))
        if "weight" in self.names:
            if state is not None:                                   # reuse: Σ_i c_i G_i
                G, perm = state
                g = torch.tensordot(factors["weight"], G, dims=1)
                grads["weight"] = g if perm is None else g.permute([d - 1 for d in perm[1:]]).contiguous()
            else:                                                   # book-keeping: ∇W for c ⊙ b
                f = factors["weight"][:, None, None, None]
                grads["weight"] = self._weight_grad(a, b.mul_(f) if own_b else b * f)
        return grads


def _kernel_offsets(m: nn.Conv2d):
    return [(u, v) for u in range(m.kernel_size[0]) for v in range(m.kernel_size[1])]


def _sq(t: torch.Tensor) -> torch.Tensor:
    """Row-wise squared Euclidean norms of a [B, n] tensor (fused, no squared copy)."""
    return torch.linalg.vector_norm(t, dim=1).square()


class GenericLayer(_Layer):
    """Any other leaf module with parameters: per-example grads by vmap over vjp of the module."""

    def kept_bytes(self, a, b):
        return 0

    def sq_norms(self, a, b, keep):
        m = self.module
        params = {attr: getattr(m, attr).detach() for attr in self.names}

        def one(p, a_i, b_i):
            _, pull = vjp(lambda q: functional_call(m, q, (a_i.unsqueeze(0),)), p)
            return pull(b_i.unsqueeze(0))[0]

        G = vmap(one, in_dims=(None, 0, 0), randomness="different")(params, a, b)
        return {attr: _sq(g.flatten(1)) for attr, g in G.items()}, G

    def clipped_sum(self, a, b, state, factors, own_b=False):
        return {attr: torch.tensordot(factors[attr], g, dims=1) for attr, g in state.items()}
