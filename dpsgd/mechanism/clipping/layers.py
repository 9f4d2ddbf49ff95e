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

CHUNK_BYTES = 32 * 2**20  # inputs unfolded (rules/conv.py) or per-example products formed at once
NORM_CHUNK_BYTES = 2**20  # per-example products formed for their norms only: a chunk stays in cache
WIDE_OUTPUT = 8  # see `transposed_weight_sum`
ROUTE = None  # "ghost" or "explicit": every sequence Linear and Conv2d takes that route (tests)
KEEP_COST = 16  # CPU: multiply-adds one float of a kept per-example product costs (see `keep_pays`)


def norm_route(T: int, d: int, p: int) -> str:
    """How the per-example norms of a layer whose example gradient is g_i = b_iᵀ a_i (a_i [T, d],
    b_i [T, p]) are formed when its products are not kept: ``ghost``, the Gram form
    ‖g_i‖² = ⟨a_i a_iᵀ, b_i b_iᵀ⟩ (T²(d + p) multiply-adds an example), or ``explicit``, g_i
    itself a few examples at a time (T·d·p), whichever costs less (Bu et al. 2023, mixed ghost
    clipping); ``ROUTE`` when set."""
    if ROUTE is not None:
        return ROUTE
    return "ghost" if T * (d + p) < d * p else "explicit"


def keep_pays(T: int, d: int, p: int) -> bool:
    """Whether forming every g_i once and keeping it, for the norms and then the clipped sum Σ_i c_i g_i
    (instead of the book-keeping weight gradient, whose T·d·p it replaces), costs less than forming
    the norms alone: the kept products cost their memory traffic, ``KEEP_COST``·d·p an example, the
    norms min(T²(d + p), T·d·p) (``norm_route``). The engine keeps a layer's products only while
    they fit its memory budget. ``ROUTE`` ghost: never; explicit: always."""
    if ROUTE is not None:
        return ROUTE == "explicit"
    return KEEP_COST * d * p < min(T * T * (d + p), T * d * p)


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

    def kept_bytes(self, a, b, K: int = 1) -> int:
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

    def kept_bytes(self, a, b, K=1):
        if "weight" not in self.names or a.dim() == 2:
            return 0
        T, d, p = a[0].numel() // a.shape[-1], a.shape[-1], b.shape[-1]
        return a.shape[0] * d * p * b.element_size() if keep_pays(T, d, p) else 0

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
    """‖b_iᵀ a_i‖²_F for A [B, T, d], Bm [B, T, p]: explicit and kept (``keep``), else by
    ``norm_route``: the ghost Gram form, or explicit in cache-sized chunks (nothing kept)."""
    T, d, p = A.shape[1], A.shape[2], Bm.shape[2]
    if keep:
        G = Bm.transpose(1, 2) @ A  # [B, p, d] per-example grads
        return _sq(G.flatten(1)), G
    if norm_route(T, d, p) == "ghost":
        return gram_sq(A, Bm), None
    sq = torch.empty(A.shape[0], dtype=A.dtype, device=A.device)
    step = max(1, NORM_CHUNK_BYTES // max(1, p * d * A.element_size()))
    for s in range(0, A.shape[0], step):  # explicit, in bounded chunks
        sq[s : s + step] = _sq((Bm[s : s + step].transpose(1, 2) @ A[s : s + step]).flatten(1))
    return sq, None


def gram_sq(A: torch.Tensor, Bm: torch.Tensor) -> torch.Tensor:
    """⟨a_i a_iᵀ, b_i b_iᵀ⟩ = ‖b_iᵀ a_i‖²_F for A [n, T, d], Bm [n, T, p] ([n]), in chunks of
    examples whose two [T, T] Gram matrices fit ``NORM_CHUNK_BYTES``."""
    n, T = A.shape[0], A.shape[1]
    sq = torch.empty(n, dtype=A.dtype, device=A.device)
    step = max(1, NORM_CHUNK_BYTES // max(1, 2 * T * T * A.element_size()))
    for s in range(0, n, step):
        a, b = A[s : s + step], Bm[s : s + step]
        ga, gb = a @ a.transpose(1, 2), b @ b.transpose(1, 2)
        sq[s : s + step] = torch.linalg.vecdot(ga.flatten(1), gb.flatten(1))
    return sq


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

    def kept_bytes(self, a, b, K=1):
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


# The base class and helpers the rules of rules/ (another package) build on, by public names.
Layer = _Layer
seq_sq_norms, sq_rows, accumulate, matmul_into, matvec_into = _seq_sq_norms, _sq, _acc, _mm, _mv
