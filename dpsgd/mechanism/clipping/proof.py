"""What an engine relies on, proved once per input signature instead of inferred from a shape.

DP-SGD's sensitivity is C only if example i's clipped gradient depends on example i alone and is
the gradient of its own loss. Two things are checked, on a copy of the model ("twin": float64, its
dropout modules off, every forward pass from the same RNG state, the run's own RNG untouched), on
the first call of each input signature (``ghost.shape_pattern``: the shapes and dtypes of the input
and of every layer call, each dimension as long as the batch named, so a dimension that merely
equals B is another signature):

1. **Independence** (every engine, ``_independence``): a black-box probe. Example j's content is
   replaced by another example's (one example, the odd-numbered ones, the second half), and every
   other example's loss must stay the same, within the round-off of computing it. A model that
   mixes examples (``h - h.mean(0)``, batch statistics in forward) is refused: NotPerExample.
2. **Structure**, for the engine that will run. Ghost (``prove_ghost``): with distinct weights w_i,
   the rules' Σ_i w_i g_i (book-keeping over each layer's rows) must equal autograd's gradient of
   Σ_i w_i ℓ_i, and the rules' per-example norms of two examples the norms of their exact gradients
   ∂ℓ_i/∂θ (one backward pass each, through the same batched graph). Rows that are not examples (a
   sequence-first layer, ``wpe(arange(T))`` with T = B, a batch reordered between layers) and a use
   of a parameter outside its module both fail the weighted sum; the plain sums then tell which
   (only the outside use fails them). Exact engines (``prove_exact``): vmap's (then the loop's)
   per-example gradients of two examples must equal the batch's; the first that does runs.

The proof runs on a sub-batch of a size that equals no other dimension (``PROBE_SIZES``) when the
twin's signature there is the call's, else on the whole batch, its examples in a fixed random
order. Tolerances: values reduced over at
most n terms (n = the parameters plus the activations autograd saved) are exact to n·eps (float64:
eps = 2.2e-16; the eps of a coarser dtype where the model computes in it whatever the twin's, e.g.
a Hugging Face RMSNorm's float32); a coupling or an outside use below that is not seen, nor a structure that changes
with the input's values at one signature. Why each choice, and the costs: docs/PERFORMANCE.md.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

from dpsgd.core.errors import NotPerExample
from dpsgd.core.runtime import ieee_float32

from .clip import example_losses
from .ghost import Capture, build_layers, check_records, output_grads
from .layers import Unsupported
from .rnn import unrolled_rnns
from .vmap import per_example_fn

PROBE_SIZES = (7, 11, 13, 17, 19, 23)  # sub-batch sizes tried, smallest first
SEED = 0x5EED  # every forward pass of a proof starts from this RNG state (forked)


@contextmanager
def forked_rng(device: torch.device):
    """The global RNG (and the device's) as it was, whatever the block draws."""
    cuda = device.type == "cuda"
    index = (torch.cuda.current_device() if device.index is None else device.index) if cuda else 0
    with torch.random.fork_rng(devices=[index] if cuda else []):
        yield


def _seeded(fn, device):
    with forked_rng(device):
        torch.default_generator.manual_seed(SEED)
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(SEED)
        return fn()


class _Twin:
    """The model the proof runs: a float64 copy where the model runs so, else a copy in its own
    dtype (or the model itself, when it cannot be copied), its dropout modules off."""

    def __init__(self, model: nn.Module, x, y, wide: bool = True):
        try:
            m = copy.deepcopy(model)
        except Exception:  # noqa: BLE001 - not copyable: the model itself, modes restored after
            m, wide = model, False
        self.model = m
        self.wide = wide and any(p.is_floating_point() for p in m.parameters())
        if self.wide:
            m.to(torch.float64)
        self.modes = [(d, d.training) for d in m.modules() if isinstance(d, _Drop)]
        for d, _ in self.modes:
            d.eval()
        cast = (lambda t: t.to(torch.float64)) if self.wide else (lambda t: t)
        self.x = cast(x) if x.is_floating_point() else x
        self.y = cast(y) if y.is_floating_point() else y
        self.eps = torch.finfo(torch.float64 if self.wide else _dtype(model)).eps

    def restore(self):
        for d, mode in self.modes:
            d.train(mode)


_Drop = nn.modules.dropout._DropoutNd


def _dtype(model) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _twin(model, x, y, run):
    """``run(twin)`` on a float64 twin; when the model cannot run in float64 (its forward raises),
    on a copy in its own dtype, TF32 off (IEEE float32)."""
    for wide in (True, False):
        twin = _Twin(model, x, y, wide)
        try:
            with torch.enable_grad(), ieee_float32(not twin.wide):
                return run(twin)
        except (NotPerExample, Unsupported, ValueError):
            raise
        except RuntimeError:
            if not twin.wide:
                raise
        finally:
            twin.restore()


def _sub_batch(n: int, literal: set[int]) -> int:
    """The smallest probe size below n that is no other dimension (n itself when none is)."""
    return next((c for c in PROBE_SIZES if c < n and c not in literal), n)


def _examples(twin, c: int, B: int, K: int):
    """(x, y) of c examples of the batch in a fixed random order (K rows each): a structure that
    follows the data's order (rows sorted by length between layers) is not proved on examples that
    happen to come sorted, and a permutation of the batch has the batch's signature."""
    idx = torch.randperm(B, generator=torch.Generator().manual_seed(SEED))[:c]
    idx = idx.to(twin.y.device)
    x = twin.x.reshape((B, K) + tuple(twin.x.shape[1:])).index_select(0, idx)
    return x.reshape((c * K,) + tuple(twin.x.shape[1:])), twin.y.index_select(0, idx)


def _named(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _rtol(twin, saved: tuple) -> float:
    """n·eps, n = the parameters plus the activations autograd saved (``saved``: their count and
    the eps of the coarsest floating dtype among them): a bound on the terms any loss, gradient or
    norm of the twin is reduced over (tests/tolerances.py's reduction_rtol). eps is the twin's,
    or coarser where the model computes below it whatever the twin's dtype (a Hugging Face RMSNorm
    casts to float32 inside: the gradient below it is rounded to float32 there)."""
    n_terms, eps = saved
    return (sum(p.numel() for p in twin.model.parameters()) + n_terms) * max(twin.eps, eps)


@contextmanager
def _saved_numel():
    """[elements, coarsest eps] of the tensors autograd saves inside the block (``_rtol``)."""
    box = [0, 0.0]

    def pack(t):
        box[0] += t.numel()
        if t.is_floating_point():
            box[1] = max(box[1], torch.finfo(t.dtype).eps)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield box


# -- independence ----------------------------------------------------------------------------------
def _perturbed(x, S: list[int], c: int, K: int):
    """x with examples S (K rows each) replaced by the next example's rows (a value change where
    that one is the same)."""
    xv = x.reshape((c, K) + tuple(x.shape[1:]))
    xp = xv.clone()
    for i in S:
        xp[i] = xv[(i + 1) % c]
        if torch.equal(xp[i], xv[i]):
            if x.dtype == torch.bool:
                xp[i] = ~xv[i]
            elif x.is_floating_point() or x.is_complex():
                xp[i] = 1 - 2 * xv[i]
            else:
                xp[i] = (xv[i] + 1) % (int(x.max()) + 1)
    return xp.reshape(x.shape)


def _independence(twin, xs, ys, c: int, K: int, loss, base, saved: tuple) -> None:
    """NotPerExample when changing some examples changes another example's loss (module doc)."""
    if c < 2:
        return
    sets = [(f"example {c // 2}", [c // 2])]
    sets.append(("the odd-numbered examples", list(range(1, c, 2))))
    sets.append((f"examples {c // 2}..{c - 1}", list(range(c // 2, c))))
    finite = base[torch.isfinite(base)]
    tol = _rtol(twin, saved) * (1 + float(finite.abs().max() if len(finite) else 0.0))
    seen = set()
    for what, S in sets:
        if tuple(S) in seen:
            continue
        seen.add(tuple(S))
        xp = _perturbed(xs, S, c, K)
        with torch.no_grad():
            lp = _seeded(partial(example_losses, twin.model, xp, ys, K, loss), xs.device)
        same = (lp == base) | (lp.isnan() & base.isnan())  # a non-finite example stays so
        d = torch.where(same, 0.0, (lp - base).abs().nan_to_num(float("inf")))
        d[S] = 0
        i = int(d.argmax())
        if float(d[i]) > tol:
            raise NotPerExample(
                f"the model mixes examples: changing {what} changed the loss of example {i} by "
                f"{float(d[i]):.3g} (its round-off bound {tol:.1g}); per-example clipping needs "
                "each example's loss to depend on that example alone (no x - x.mean(0), no batch "
                "statistics in forward)"
            )


# -- the ghost engine --------------------------------------------------------------------------
def prove_ghost(model, x, y, K: int, loss, signature: tuple) -> str | None:
    """None when the ghost rules' rows are the examples for this call's ``signature`` (module
    doc); else why not, naming the parameter. NotPerExample when examples mix; ValueError when
    the probe's loss or gradients are not finite."""
    B = y.shape[0]
    literal = {d for call in signature for d in call[1] + call[3] if isinstance(d, int)}
    literal |= {d for d in tuple(x.shape[1:]) + tuple(y.shape[1:])}

    def run(twin):
        layers, _ = build_layers(twin.model)
        c = _sub_batch(B, literal)
        for size in (c, B) if c < B else (B,):
            xs, ys = _examples(twin, size, B, K)
            cap, ell, saved = _seeded(
                partial(_hooked, twin.model, layers, xs, ys, K, loss), xs.device
            )
            if _calls(cap.signature(size * K, size)) == _calls(signature):
                break
        else:
            return (
                "the float64 copy of the model calls its layers with other shapes than the model "
                "on this input: its structure is not proved"
            )
        check_records(layers, cap.records, size * K)
        _finite(ell, "loss")
        _independence(twin, xs, ys, size, K, loss, ell.detach(), saved)
        return _ghost_structure(twin, layers, cap, ell, size, K, saved)

    try:
        return _twin(model, x, y, run)
    except Unsupported as e:
        return str(e)


def _hooked(model, layers, xs, ys, K: int, loss):
    """(the capture, each example's loss, (elements, coarsest eps) autograd saved) of one forward
    pass."""
    with Capture(layers) as cap, _saved_numel() as saved:
        ell = example_losses(model, xs, ys, K, loss)
    return cap, ell, tuple(saved)


def _calls(signature) -> list:
    """A signature without its dtypes (the twin computes in float64)."""
    return [(i, p, q) for i, p, _, q, _ in signature]


def _ghost_structure(twin, layers, cap, ell, c: int, K: int, saved: tuple) -> str | None:
    order, bs = output_grads(cap.records, ell.sum(), retain=True)
    w = 0.5 + torch.rand(c, generator=torch.Generator().manual_seed(SEED), dtype=torch.float64)
    w = w.to(device=ell.device, dtype=ell.dtype)
    ones = torch.ones_like(w)
    mine_w, mine_1, sq = {}, {}, {}
    with torch.no_grad():  # the rules, as the engine runs them
        for i, b in zip(order, bs):
            if b is None:
                continue
            layer = layers[i]
            a, bb, k = layer.inputs(cap.records[i].input, b, K)
            sqn, state = layer.sq_norms(a, bb, False, k)
            for attr, v in sqn.items():
                sq[layer.names[attr]] = v
            for mine, f in ((mine_w, w), (mine_1, ones)):
                sums = layer.clipped_sum(a, bb, state, {t: f for t in layer.names}, K=k)
                mine.update({layer.names[t]: g for t, g in sums.items()})
    named = _named(twin.model)
    params = [p for _, p in named]

    def grads(root):
        gs = torch.autograd.grad(root, params, retain_graph=True, allow_unused=True)
        return {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(named, gs)}

    ref_w = grads((w * ell).sum())
    rows = sorted({0, c - 1})
    ref_rows = [grads(ell[r]) for r in rows]
    for g in (ref_w, *ref_rows):
        _finite_grads(g)
    rtol = _rtol(twin, saved)
    zero = {n: torch.zeros_like(p) for n, p in named}
    kind = {n: type(l.module).__name__ for l in layers for n in l.names.values()}
    what = {n: f"parameter '{n}'" + (f" ({kind[n]})" if n in kind else "") for n in ref_w}
    off = {n: _rel_err(mine_w.get(n, zero[n]), ref_w[n], ref_w, rtol) for n in ref_w}
    if any(e is not None for e in off.values()):  # which of the two: the plain sums tell
        ref_1 = grads(ell.sum())
        for n in ref_1:
            e1 = _rel_err(mine_1.get(n, zero[n]), ref_1[n], ref_1, rtol)
            if e1 is not None:
                return (
                    f"{what[n]} receives gradient from outside its module's forward call (its "
                    f"rule sees the batch's gradient off by {e1:.2g} relative; e.g. weight tying "
                    "or functional use)"
                )
        n, e = next((n, e) for n, e in off.items() if e is not None)
        return (
            f"{what[n]}: its layer's rows are not the examples on this input (weighted "
            f"per-example sums off by {e:.2g} relative: a dimension as long as the batch taken as "
            "the batch, or rows reordered between layers)"
        )
    for r, ref in zip(rows, ref_rows):
        scale = max(float(g.norm()) for g in ref.values())
        for n, g in ref.items():
            got = float(sq[n][r].clamp_min(0).sqrt()) if n in sq else 0.0
            if abs(got - float(g.norm())) > rtol * (float(g.norm()) + scale):
                return (
                    f"parameter '{n}': its per-example gradient norm of example {r} is {got:.6g}, "
                    f"the exact one {float(g.norm()):.6g}"
                )
    return None


def _rel_err(got, ref, refs: dict, rtol: float) -> float | None:
    scale = max(float(t.norm()) for t in refs.values())
    err = float((got - ref).norm())
    if err <= rtol * (float(ref.norm()) + scale):
        return None
    return err / max(float(ref.norm()), scale, torch.finfo(torch.float64).tiny)


def _finite(t, what: str) -> None:
    if not bool(torch.isfinite(t).all()):
        raise ValueError(
            f"clipped_sum: the {what} is not finite (NaN or inf) on this lot: an example holds a "
            "non-finite value or the loss overflowed (check_finite=False skips the check that "
            "names the example)"
        )


def _finite_grads(grads: dict) -> None:
    for n, g in grads.items():
        if not bool(torch.isfinite(g).all()):
            _finite(g, f"gradient of parameter '{n}'")


# -- the exact engines ---------------------------------------------------------------------------
def prove_exact(model, x, y, K: int, loss, engines=("vmap", "loop")) -> tuple[str, dict, bool]:
    """(the first of ``engines`` whose per-example gradients of two examples equal the batch's,
    {engine: why not} for those before it, proved). NotPerExample when examples mix or none does.
    proved is False when an example's loss is not finite (check_finite=False): a NaN reaches the
    batch's every gradient, so the engines are not compared (the signature is proved later)."""
    B = y.shape[0]
    literal = set(tuple(x.shape[1:]) + tuple(y.shape[1:]))

    def run(twin):
        c = _sub_batch(B, literal)
        xs, ys = _examples(twin, c, B, K)

        def forward():
            with _saved_numel() as saved:
                ell = example_losses(twin.model, xs, ys, K, loss)
            return ell.detach(), tuple(saved)

        ell, saved = _seeded(forward, xs.device)
        _independence(twin, xs, ys, c, K, loss, ell, saved)
        if not bool(torch.isfinite(ell).all()):  # a NaN reaches every gradient of the batch:
            return engines[0], {}, False  # nothing to compare (and the clipped sum not finite)
        training = twin.model.training
        twin.model.eval()  # the engines draw their own dropout masks: compared without any
        try:
            return (*_exact_engine(twin, xs, ys, sorted({0, c - 1}), K, loss, engines, saved), True)
        finally:
            twin.model.train(training)

    return _twin(model, x, y, run)


def _exact_engine(twin, xs, ys, rows: list, K: int, loss, engines, saved: tuple):
    named = _named(twin.model)
    params = [p for _, p in named]

    def batch_grads(seed_shift=0):
        def f():
            torch.default_generator.manual_seed(SEED + seed_shift)
            ell = example_losses(twin.model, xs, ys, K, loss)
            out = []
            for r in rows:
                gs = torch.autograd.grad(ell[r], params, retain_graph=True, allow_unused=True)
                out.append(
                    {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(named, gs)}
                )
            return out

        return _seeded(f, xs.device)

    ref = batch_grads()
    for g in ref:
        _finite_grads(g)
    rtol = _rtol(twin, saved)
    why = {}
    for engine in engines:
        try:
            got = _seeded(
                partial(_engine_grads, engine, twin.model, xs, ys, rows, K, loss), xs.device
            )
        except Exception as e:  # noqa: BLE001 - the engine cannot run this model: the next one
            why[engine] = (
                f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            )
            continue
        bad = _compare_rows(got, ref, rows, rtol)
        if bad is None:
            return engine, why
        again = batch_grads(1)  # a model random even in eval mode: the comparison says nothing
        if _compare_rows(again, ref, rows, rtol) is not None:
            return engine, why
        why[engine] = bad
    raise NotPerExample(
        "no exact per-example path computes this model's per-example gradients: "
        + "; ".join(f"{e}: {w}" for e, w in why.items())
    )


def _engine_grads(engine, model, xs, ys, rows, K: int, loss) -> list[dict]:
    named = _named(model)
    if engine == "vmap":
        with unrolled_rnns(model):
            params, fn = per_example_fn(model, K, loss)
            idx = torch.tensor(rows, device=xs.device)
            xv = xs.reshape((-1, K) + tuple(xs.shape[1:])) if K > 1 else xs
            g, _ = fn(params, xv.index_select(0, idx), ys.index_select(0, idx))
        return [{n: g[n][j] for n, _ in named} for j in range(len(rows))]
    out = []
    for r in rows:
        ell = example_losses(model, xs[r * K : (r + 1) * K], ys[r : r + 1], K, loss)[0]
        gs = torch.autograd.grad(ell, [p for _, p in named], allow_unused=True)
        out.append({n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(named, gs)})
    return out


def _compare_rows(got, ref, rows, rtol: float) -> str | None:
    for r, mine, exact in zip(rows, got, ref):
        scale = max(float(g.norm()) for g in exact.values())
        for n, g in exact.items():
            err = float((mine[n] - g).norm())
            if err > rtol * (float(g.norm()) + scale):
                return (
                    f"the gradient of '{n}' for example {r} alone differs from the batch's by "
                    f"{err / max(float(g.norm()), scale, 1e-300):.2g} relative (the model computes "
                    "an example differently alone than in a batch)"
                )
    return None
