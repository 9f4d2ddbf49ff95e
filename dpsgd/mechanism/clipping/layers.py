"""Per-layer rules of the ghost engine: per-example squared norms and clipped sums.

Each rule gets a layer's input a and output gradient b (of Σ_i loss_i) for the physical batch:
  LinearLayer  (any input [B, ..., d]): ‖a_i‖²‖b_i‖² on 2-D input; otherwise the ghost Gram form
               ⟨a_i a_iᵀ, b_i b_iᵀ⟩ or the explicit ‖b_iᵀ a_i‖², whichever is cheaper (Bu et al.
               2023);
  Conv2dLayer  explicit per-example products, one kernel row at a time, without a full unfold (see
  the class); GroupNormLayer per-example [B, C] sums Σ_spatial x̂ ⊙ b (weight) and Σ_spatial b
  (bias), exact; GenericLayer any other leaf module with parameters: vmap of the module's vjp
  (exact, materialises).
The first three are registered for their module types (``registry.py``: ``@register_layer``);
GenericLayer is the fallback for leaf modules without a registered rule.
Clipped sums are book-keeping: (c ⊙ b)ᵀ a, or the weighted sum of kept per-example products.

Augmentation multiplicity (De et al. 2022, arXiv 2204.13650): with K augmented copies per example
the batch holds B·K rows (example i's copies are rows iK .. iK+K−1) and example i's gradient is the
sum over its K rows (the 1/K of the mean is in b already). Every rule takes K: its per-row
quantities are summed over each example's K rows *before* the norm (`group_rows`); book-keeping sums
repeat each example's clip factor over its K rows. K = 1 runs the unchanged code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vjp, vmap

from .registry import register_layer

CHUNK_BYTES = 32 * 2**20  # per-example products formed at once when not kept
WIDE_OUTPUT = 8  # see `transposed_weight_sum`


def transposed_weight_sum(p: int, d: int) -> bool:
    """Whether a CPU Linear layer with d inputs and p outputs forms its clipped weight sum as
    (aᵀ (c ⊙ b))ᵀ: a [d, p] product and a transposed copy, which the CPU BLAS runs faster when the
    layer widens its input p ≥ WIDE_OUTPUT·d times (`python -m bench.bench_gemm`,
    results/bench_gemm.csv)."""
    return p >= WIDE_OUTPUT * d


def group_rows(t: torch.Tensor, K: int) -> torch.Tensor:
    """[B·K, ...] per-row quantities → [B, ...] per-example sums over each example's K rows."""
    return t if K == 1 else t.view((t.shape[0] // K, K) + tuple(t.shape[1:])).sum(1)


def repeat_factors(f: torch.Tensor, K: int) -> torch.Tensor:
    """Per-example clip factors [B] → per-row [B·K] (each example's factor on each of its rows)."""
    return f if K == 1 else f.repeat_interleave(K)


class Unsupported(RuntimeError):
    """The model's structure is outside what the ghost engine can handle exactly."""


class _Layer:
    """One parameter-owning module: names of its trainable parameters, by attribute."""

    owns_forward = False  # True: ``forward(record, *args)`` replaces the module's own (rnn.py)

    def __init__(self, module: nn.Module, names: dict[str, str]):
        self.module = module
        self.names = names  # attribute ("weight", "bias", ...) -> full parameter name

    @property
    def label(self) -> str:
        """ "module 'fc' (Linear)", for messages (the module's path from its parameters' names)."""
        attr, full = next(iter(self.names.items()))
        path = full[: -len(attr) - 1] if full != attr else "<root>"
        return f"module '{path}' ({type(self.module).__name__})"

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of its (first trained) parameter: its rules compute in it."""
        return getattr(self.module, next(iter(self.names))).dtype

    def inputs(self, a, b, K: int):
        """(a, b, rows per example still to sum) as the rules take them: the recorded input
        prepared, both in the dtype of the layer's parameters."""
        dtype = self.dtype
        a = None if a is None else self.prepare(a)
        if a is not None and a.is_floating_point() and a.dtype != dtype:
            a = a.to(dtype)
        if b.dtype != dtype:
            b = b.to(dtype)
        return self.group(a, b, K)

    @property
    def needs_input(self) -> bool:
        """Whether the rules read the input a: not when the weight is frozen (requires_grad=False)
        and only the bias is trained, whose per-example gradient is b alone. Then a is not kept."""
        return "weight" in self.names

    def check_input(self, a: torch.Tensor) -> None:
        """Raise Unsupported for an input these rules cannot handle (checked even when a is not
        kept)."""

    def prepare(self, a: torch.Tensor) -> torch.Tensor:
        return a

    def group(self, a, b, K: int):
        """(a, b, K) as the rules below take them; a rule that can fold the K rows of an example
        into its own layout (Linear: K·T positions) returns K = 1."""
        return a, b, K

    def sq_norms(self, a, b, keep: bool, K: int = 1):
        """(dict attr -> [B] squared per-example norms, state reused by `clipped_sum`)."""
        raise NotImplementedError

    def clipped_sum(
        self,
        a,
        b,
        state,
        factors: dict[str, torch.Tensor],
        own_b: bool = False,
        out: dict[str, torch.Tensor] | None = None,
        K: int = 1,
    ):
        """dict attr -> Σ_i factors[attr]_i g_i(attr), added into out[attr] in place when given.

        own_b: b is a buffer nothing else reads afterwards (contiguous, sharing memory with no
        other layer's a or b), so it may be rescaled in place instead of copied."""
        raise NotImplementedError

    def kept_bytes(self, a, b) -> int:
        """Memory for keeping explicit per-example products (0: nothing worth keeping)."""
        return 0


@register_layer(nn.Linear)
class LinearLayer(_Layer):
    def group(self, a, b, K):
        """Example i's gradient Σ_k Σ_t b_iktᵀ a_ikt is a sequence layer's over K·T positions: the
        rows [B·K, T, d] are viewed as [B, K·T, d] (no copy), and the sequence rules apply."""
        if K == 1:
            return a, b, 1
        seq = lambda t: None if t is None else t.reshape(t.shape[0] // K, -1, t.shape[-1])
        return seq(a), seq(b), 1

    def sq_norms(self, a, b, keep, K=1):
        out = {}
        if b.dim() == 2:  # T = 1: (‖a_i‖ ‖b_i‖)²
            nb = torch.linalg.vector_norm(b, dim=1)
            if "weight" in self.names:
                out["weight"] = torch.linalg.vector_norm(a, dim=1).mul_(nb).square_()
            if "bias" in self.names:
                out["bias"] = nb.square_()
            return out, None
        Bm = b.flatten(1, -2)  # [B, T, p]
        state = None
        if "weight" in self.names:  # a: [B, T, d]
            out["weight"], state = _seq_sq_norms(a.flatten(1, -2), Bm, keep)
        if "bias" in self.names:
            out["bias"] = _sq(Bm.sum(1))
        return out, state

    def kept_bytes(self, a, b):
        if "weight" not in self.names or a.dim() == 2:
            return 0
        return a.shape[0] * a.shape[-1] * b.shape[-1] * b.element_size()

    def clipped_sum(self, a, b, state, factors, own_b=False, out=None, K=1):
        out = out or {}
        grads = {}
        if b.dim() == 2:
            if "bias" in self.names:  # before b may be rescaled
                grads["bias"] = _mv(b.t(), factors["bias"], out.get("bias"))
            if "weight" in self.names:  # (c ⊙ b)ᵀ a: scale the smaller,
                f = factors["weight"][:, None]  # or b in place (no new buffer)
                if b.is_cpu and transposed_weight_sum(b.shape[1], a.shape[1]):
                    grads["weight"] = _acc(((a * f).t() @ b).t(), out.get("weight"))
                else:
                    if own_b and b.shape[1] <= 2 * a.shape[1]:
                        lhs, rhs = b.mul_(f).t(), a
                    elif b.shape[1] <= a.shape[1]:
                        lhs, rhs = (b * f).t(), a
                    else:
                        lhs, rhs = b.t(), a * f
                    grads["weight"] = _mm(lhs, rhs, out.get("weight"))
            return grads
        Bm = b.flatten(1, -2)
        if "bias" in self.names:
            grads["bias"] = _mv(Bm.sum(1).t(), factors["bias"], out.get("bias"))
        if "weight" in self.names:
            A = a.flatten(1, -2)
            if state is not None:  # reuse explicit b_iᵀ a_i
                grads["weight"] = _acc(
                    torch.tensordot(factors["weight"], state, dims=1), out.get("weight")
                )
            else:
                f = factors["weight"][:, None, None]
                Bc = Bm.mul_(f) if own_b else Bm * f
                grads["weight"] = _mm(Bc.flatten(0, 1).t(), A.flatten(0, 1), out.get("weight"))
        return grads


def _seq_sq_norms(A, Bm, keep: bool):
    """‖b_iᵀ a_i‖²_F for A [B, T, d], Bm [B, T, p]; explicit when kept or cheaper, else ghost."""
    T, d, p = A.shape[1], A.shape[2], Bm.shape[2]
    if keep:
        G = Bm.transpose(1, 2) @ A  # [B, p, d] per-example grads
        return _sq(G.flatten(1)), G
    if T * (d + p) < d * p:  # ghost Gram form is cheaper
        return ((A @ A.transpose(1, 2)) * (Bm @ Bm.transpose(1, 2))).sum((1, 2)), None
    sq = torch.empty(A.shape[0], dtype=A.dtype, device=A.device)
    step = max(1, CHUNK_BYTES // max(1, p * d * A.element_size()))
    for s in range(0, A.shape[0], step):  # explicit, in bounded chunks
        sq[s : s + step] = _sq((Bm[s : s + step].transpose(1, 2) @ A[s : s + step]).flatten(1))
    return sq, None


@register_layer(nn.Conv2d)
class Conv2dLayer(_Layer):
    """Conv2d of any stride/padding/dilation/groups/padding_mode, on [B, C, H, W] input.

    Per-example weight gradients, without a fully unfolded copy of the input (kh·kw times its size):
    for groups = 1 and ≥ 16 input channels, one batched matrix product per kernel row on an input
    unfolded along its width only (see `_row_products`); otherwise one grouped weight-gradient
    convolution with B·groups groups (each example its own group). When they fit the memory
    budget they are kept and reused for the clipped sum; otherwise only their norms are formed
    (kernel row by kernel row, or in chunks) and the clipped sum is the layer's ordinary weight
    gradient for the rescaled output gradient c ⊙ b (book-keeping).
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
        n, cout, ho, wo = b.shape
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
            sq[s // K : s // K + G_u.shape[0]] += _sq(G_u.flatten(1))
        return sq

    def kept_bytes(self, a, b):
        if "weight" not in self.names:
            return 0
        return a.shape[0] * self.module.weight.numel() * b.element_size()

    def sq_norms(self, a, b, keep, K=1):
        out, state = {}, None
        if "weight" in self.names:
            if keep:
                G, perm = self._per_example(a, b)
                state = (group_rows(G, K), perm)
                out["weight"] = _sq(state[0].flatten(1))
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
                    sq[s // K : s // K + G.shape[0]] = _sq(G.flatten(1))
                out["weight"] = sq
        if "bias" in self.names:
            out["bias"] = _sq(group_rows(b.sum((2, 3)), K))
        return out, state

    def clipped_sum(self, a, b, state, factors, own_b=False, out=None, K=1):
        out = out or {}
        grads = {}
        if "bias" in self.names:
            grads["bias"] = _mv(group_rows(b.sum((2, 3)), K).t(), factors["bias"], out.get("bias"))
        if "weight" in self.names:
            if state is not None:  # reuse: Σ_i c_i G_i
                G, perm = state
                g = torch.tensordot(factors["weight"], G, dims=1)
                g = g if perm is None else g.permute([d - 1 for d in perm[1:]])
            else:  # book-keeping: ∇W for c ⊙ b
                f = repeat_factors(factors["weight"], K)[:, None, None, None]
                g = self._weight_grad(a, b.mul_(f) if own_b else b * f)
            grads["weight"] = _acc(g, out.get("weight"))
        return grads


def _mm(lhs, rhs, out):
    """lhs @ rhs, or out += lhs @ rhs in place (one GEMM with β = 1: no temporary, no extra
    pass)."""
    return lhs @ rhs if out is None else out.addmm_(lhs, rhs)


def _mv(mat, vec, out):
    return mat @ vec if out is None else out.addmv_(mat, vec)


def _acc(g, out):
    return g.contiguous() if out is None else out.add_(g)


_ROWDOT_BYTES = 1 << 18  # the product of one chunk of examples stays in cache


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_s a[i, c, s]·b[i, c, s] as [B, C], a few examples at a time (the same products and sums
    as (a * b).sum(2), without a [B, C, S] temporary)."""
    k = max(1, _ROWDOT_BYTES // max(1, a[0].numel() * a.element_size()))
    out = a.new_empty(a.shape[:2])
    for i in range(0, len(a), k):
        torch.sum(a[i : i + k] * b[i : i + k], 2, out=out[i : i + k])
    return out


def _sq(t: torch.Tensor) -> torch.Tensor:
    """Row-wise squared Euclidean norms of a [B, n] tensor (fused, no squared copy)."""
    return torch.linalg.vector_norm(t, dim=1).square()


@register_layer(nn.GroupNorm)
class GroupNormLayer(_Layer):
    """nn.GroupNorm (Wu & He 2018) with affine parameters, on input [B, C, *] (any spatial dims).

    y = x̂ ⊙ γ + β per channel, with x̂ = (x − μ_g(x)) / √(σ²_g(x) + ε) normalised per example and
    group (no statistic crosses examples). So example i's gradients are, exactly,
        ∂ℓ_i/∂γ_c = Σ_s x̂_i[c, s] b_i[c, s],      ∂ℓ_i/∂β_c = Σ_s b_i[c, s]      ([B, C] each)
    formed from the recorded input (x̂ recomputed by F.group_norm without affine) and the output
    gradient b: nothing per-example beyond [B, C], the size of the parameters times B.
    """

    def check_input(self, a):
        if a.dim() < 2:
            raise Unsupported(f"{self.label} got input of shape {list(a.shape)}; needs [B, C, *]")

    def prepare(self, a):
        m = self.module
        return F.group_norm(a, m.num_groups, None, None, m.eps)  # x̂

    def _per_example(self, a, b, K):
        G = {}
        if "weight" in self.names:
            G["weight"] = group_rows(
                _rowdot(a.flatten(2), b.flatten(2)) if b.dim() > 2 else a * b, K
            )
        if "bias" in self.names:
            G["bias"] = group_rows(b.flatten(2).sum(2) if b.dim() > 2 else b, K)
        return G

    def sq_norms(self, a, b, keep, K=1):
        G = self._per_example(a, b, K)
        return {attr: _sq(g) for attr, g in G.items()}, G

    def clipped_sum(self, a, b, state, factors, own_b=False, out=None, K=1):
        out = out or {}
        return {attr: _mv(g.t(), factors[attr], out.get(attr)) for attr, g in state.items()}


class GenericLayer(_Layer):
    """Any other leaf module with parameters: per-example grads by vmap over vjp of the module."""

    needs_input = True  # the module's vjp at a, whatever it trains

    def kept_bytes(self, a, b):
        return 0

    def sq_norms(self, a, b, keep, K=1):
        m = self.module
        params = {attr: getattr(m, attr).detach() for attr in self.names}

        def one(p, a_i, b_i):
            _, pull = vjp(lambda q: functional_call(m, q, (a_i.unsqueeze(0),)), p)
            return pull(b_i.unsqueeze(0))[0]

        G = vmap(one, in_dims=(None, 0, 0), randomness="different")(params, a, b)
        G = {attr: group_rows(g, K) for attr, g in G.items()}
        return {attr: _sq(g.flatten(1)) for attr, g in G.items()}, G

    def clipped_sum(self, a, b, state, factors, own_b=False, out=None, K=1):
        out = out or {}
        return {
            attr: _acc(torch.tensordot(factors[attr], g, dims=1), out.get(attr))
            for attr, g in state.items()
        }
