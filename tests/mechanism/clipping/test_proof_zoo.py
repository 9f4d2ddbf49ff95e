"""The proofs of dpsgd/mechanism/clipping/proof.py on the models that fooled the shape test.

Each model, on every layout with T ≠ B and T = B: ``mode="auto"`` is the float64 batch-of-1 loop
(tests/dp_reference.py; relative error reduction_rtol(P), P the gradient's entries: every value is
reduced over at most P terms) or refused in one line; a model that mixes examples is refused by
every engine, PrivateTrainer and the command line; each fallback is said once.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dp_reference import assert_close, loop_clipped_sum
from dpsgd.core.errors import NotPerExample
from dpsgd.mechanism.clipping import PerExampleClipper

DT = torch.float64
C = 0.05  # small: every example clipped, so a wrong grouping changes the clipped sum
D, H, V, NCLS = 5, 6, 11, 3  # features, hidden width, vocabulary, classes


class SeqFirstLinear(nn.Module):
    """A Linear on [T, B, d] (``fc(x.transpose(0, 1))``)."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(D, H), nn.Linear(H, NCLS)

    def forward(self, x):  # [B, T, D]
        return self.head(torch.tanh(self.fc(x.transpose(0, 1))).mean(0))


class SeqFirstEmbedding(nn.Module):
    """An Embedding looked up with [T, B] indices."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(V, H), nn.Linear(H, NCLS)

    def forward(self, idx):  # [B, T]
        return self.head(torch.tanh(self.emb(idx.t())).mean(0))


class SeqFirstTransformer(nn.Module):
    """nn.TransformerEncoder(batch_first=False)."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(H, 2, 8, dropout=0.0, batch_first=False)
        self.inp, self.enc = (
            nn.Linear(D, H),
            nn.TransformerEncoder(layer, 1, enable_nested_tensor=False),
        )
        self.head = nn.Linear(H, NCLS)

    def forward(self, x):  # [B, T, D]
        return self.head(self.enc(self.inp(x).transpose(0, 1)).mean(0))


class PositionalGPT(nn.Module):
    """nanoGPT's ``wte(idx) + wpe(torch.arange(T))``."""

    def __init__(self, T):
        super().__init__()
        self.wte, self.wpe, self.head = nn.Embedding(V, H), nn.Embedding(T, H), nn.Linear(H, NCLS)

    def forward(self, idx):
        h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        return self.head(torch.tanh(h).mean(1))


class LearnedQueries(nn.Module):
    """Q learned queries ``queries(torch.arange(Q))`` attending over the tokens."""

    def __init__(self, Q):
        super().__init__()
        self.Q = Q
        self.inp, self.queries = nn.Linear(D, H), nn.Embedding(Q, H)
        self.head = nn.Linear(Q * H, NCLS)

    def forward(self, x):  # [B, T, D]
        k = self.inp(x)  # [B, T, H]
        q = self.queries(torch.arange(self.Q, device=x.device))  # [Q, H]
        att = torch.softmax(torch.einsum("qh,bth->bqt", q, k), -1)
        return self.head(torch.einsum("bqt,bth->bqh", att, k).flatten(1))


class OutsideOnLong(nn.Module):
    """fc.weight used outside fc's forward call only on inputs longer than 4 (coefficient c)."""

    def __init__(self, c=0.1):
        super().__init__()
        self.c, self.fc, self.head = c, nn.Linear(D, D), nn.Linear(D, NCLS)

    def forward(self, x):  # [B, T, D]
        h = torch.tanh(self.fc(x))
        if x.shape[1] > 4:
            h = h + self.c * F.linear(h, self.fc.weight)
        return self.head(h.mean(1))


class Reordered(nn.Module):
    """The batch sorted by a feature between two layers, then restored (sort by length)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(D, H), nn.Linear(H, H), nn.Linear(H, NCLS)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        order = h[:, 0].argsort()
        h = torch.tanh(self.b(h[order]))[order.argsort()]
        return self.head(h)


class MaskedSubBatch(nn.Module):
    """Two heads on boolean-mask sub-batches (data-dependent shapes)."""

    def __init__(self):
        super().__init__()
        self.a, self.pos, self.neg = nn.Linear(D, H), nn.Linear(H, NCLS), nn.Linear(H, NCLS)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        m = h[:, 0] > 0
        out = h.new_zeros(h.shape[0], NCLS)
        out[m] = self.pos(h[m])
        out[~m] = self.neg(h[~m])
        return out


class MeanMix(nn.Module):
    def __init__(self, c=1.0):
        super().__init__()
        self.c, self.a, self.head = c, nn.Linear(D, H), nn.Linear(H, NCLS)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.head(h - self.c * h.mean(0))


class FunctionalBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(D, H), nn.Linear(H, NCLS)

    def forward(self, x):
        return self.head(F.batch_norm(self.a(x), None, None, training=True))


def seq(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D, generator=g, dtype=DT), torch.randint(0, NCLS, (B,), generator=g)


def tokens(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, NCLS, (B,), generator=g)


def flat(B, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, D, generator=g, dtype=DT), torch.randint(0, NCLS, (B,), generator=g)


def exact_or_refused(model, x, y, mode="auto", clipping="global"):
    """The clipper's sum equals the float64 batch-of-1 loop; returns (clipper, warnings said)."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        clipper = PerExampleClipper(model, C, clipping, mode=mode)
        res = clipper.clipped_sum(x, y)
    ref, ref_norms = loop_clipped_sum(model, x, y, clipper.groups, C)
    assert (ref_norms > C).any()
    assert_close(res.grads, ref)
    return clipper, [str(w.message) for w in said]


def one_line_refusal(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# -- a dimension as long as the batch is not the batch ---------------------------------------------
SEQUENCE_MODELS = {
    "seq_first_linear": (SeqFirstLinear, seq),
    "seq_first_embedding": (SeqFirstEmbedding, tokens),
    "seq_first_transformer": (SeqFirstTransformer, seq),
    "wpe_arange": (PositionalGPT, tokens),
    "learned_queries": (LearnedQueries, seq),
}


@pytest.mark.parametrize("name", list(SEQUENCE_MODELS))
@pytest.mark.parametrize("B, T", [(6, 4), (6, 6), (4, 6)])
def test_sequence_layouts_are_exact_whatever_T_is(name, B, T):
    cls, data = SEQUENCE_MODELS[name]
    model = (cls(T) if cls in (PositionalGPT, LearnedQueries) else cls()).to(DT)
    x, y = data(B, T)
    clipper, said = exact_or_refused(model, x, y)
    assert len(said) <= 1  # a fallback is said once, at build or on the first call
    for s in said:
        assert "exact per-example path" in s or "per-example loop" in s


@pytest.mark.parametrize("name", ["seq_first_linear", "seq_first_embedding", "wpe_arange"])
def test_ghost_refuses_rows_that_are_not_examples_in_one_line(name):
    cls, data = SEQUENCE_MODELS[name]
    model = (cls(6) if cls is PositionalGPT else cls()).to(DT)
    x, y = data(6, 6)  # T = B: the shapes pass; the proof does not
    with pytest.raises(NotPerExample, match=r"^mode='ghost' cannot handle this model: ") as e:
        PerExampleClipper(model, C, mode="ghost").clipped_sum(x, y)
    msg = one_line_refusal(e)
    assert "rows are not the examples" in msg or "does not keep the batch" in msg


def test_the_proof_names_the_layer_and_why():
    model = SeqFirstLinear().to(DT)
    x, y = seq(6, 6)
    with pytest.warns(UserWarning) as said:
        PerExampleClipper(model, C).clipped_sum(x, y)
    (msg,) = [str(w.message) for w in said]
    assert msg.startswith("ghost clipping: parameter 'fc.weight' (Linear): its layer's rows are")
    assert "x [B, B, 5] float64" in msg and "run on the exact per-example path (vmap)" in msg


def test_a_new_signature_is_proved_and_the_old_one_stays_ghost():
    """T = 6: at B = 4 the fc input [6, 4, d] is refused by its shape (vmap); at B = 6 it looks like
    a batch to the hooks: proved wrong (vmap); B = 5 = D is a third signature, refused by its shape
    again (said once per reason); B = 6 and 4 again: nothing new to prove or say."""
    model = SeqFirstLinear().to(DT)
    clipper = PerExampleClipper(model, C)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for B in (4, 6, 5, 6, 4):
            x, y = seq(B, 6, seed=B)
            res = clipper.clipped_sum(x, y)
            ref, _ = loop_clipped_sum(model, x, y, clipper.groups, C)
            assert_close(res.grads, ref)
    assert len(said) == 2 and clipper.mode == "ghost+vmap"  # [6, B] by its shape, [B, B] proved
    assert len(clipper._exact) == 3


def test_fixed_size_lots_with_T_equal_to_the_physical_batch_train_exactly():
    """PrivateTrainer(sampling=fixed_size, lot 16, physical batches of 8) on T = 8: every physical
    batch has T = B; the proof moves them to vmap, and the trainer's clipped sums are the loop's."""
    import dpsgd

    g = torch.Generator().manual_seed(3)
    X, y = torch.randn(64, 8, D, generator=g), torch.randint(0, NCLS, (64,), generator=g)
    model = SeqFirstLinear()
    with pytest.warns(UserWarning, match="rows are not the examples"):
        t = dpsgd.PrivateTrainer(
            model, (X, y), lot_size=16, sampling="fixed_size", physical_batch_size=8, sigma=1.0,
            clip_norm=C, threads=False,
        )  # fmt: skip
        t.train_epoch(max_lots=2)
    model64 = SeqFirstLinear().to(DT)
    model64.load_state_dict({k: v.to(DT) for k, v in model.state_dict().items()})
    clipper = PerExampleClipper(model64, C)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = clipper.clipped_sum(X[:8].to(DT), y[:8])
    ref, _ = loop_clipped_sum(model64, X[:8].to(DT), y[:8], clipper.groups, C)
    assert_close(res.grads, ref)


# -- parameters used outside their module ---------------------------------------------------------
@pytest.mark.parametrize("coefficient", [0.1, 1e-4])
def test_an_outside_use_on_long_inputs_only_is_found_when_they_come(coefficient):
    model = OutsideOnLong(coefficient).to(DT)
    clipper = PerExampleClipper(model, C)
    x, y = seq(6, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # short inputs: ghost, proved, nothing said
        res = clipper.clipped_sum(x, y)
    assert clipper.mode == "ghost"
    assert_close(res.grads, loop_clipped_sum(model, x, y, clipper.groups, C)[0])
    x, y = seq(6, 7, seed=1)
    with pytest.warns(UserWarning, match="'fc.weight' .* receives gradient from outside"):
        res = clipper.clipped_sum(x, y)
    assert clipper.mode == "ghost+vmap"
    assert_close(res.grads, loop_clipped_sum(model, x, y, clipper.groups, C)[0])


def test_a_batch_reordered_between_layers_is_exact():
    model = Reordered().to(DT)
    x, y = flat(9)
    clipper, said = exact_or_refused(model, x, y)
    assert clipper.mode == "ghost+vmap" and len(said) == 1
    assert "'b.weight' (Linear): its layer's rows are not the examples" in said[0]


def test_a_reordering_is_found_on_a_batch_that_comes_sorted():
    """The batch arrives in the order the model sorts it by (a dataset sorted by length): the
    model's permutation is the identity on it, but the proof takes its examples in a random order,
    so the next (unsorted) batch of the same signature is exact too."""
    model = Reordered().to(DT)
    x, y = flat(9)
    with torch.no_grad():
        x = x[torch.tanh(model.a(x))[:, 0].argsort()]  # sorted: h[order] is h
    clipper = PerExampleClipper(model, C)
    with pytest.warns(UserWarning, match="'b.weight' .* rows are not the examples"):
        clipper.clipped_sum(x, y)
    x2, y2 = flat(9, seed=1)
    res = clipper.clipped_sum(x2, y2)
    assert_close(res.grads, loop_clipped_sum(model, x2, y2, clipper.groups, C)[0])


def test_boolean_mask_sub_batches_run_on_the_loop_or_are_refused():
    model = MaskedSubBatch().to(DT)
    x, y = flat(10)
    clipper, said = exact_or_refused(model, x, y)
    assert clipper.mode == "ghost+loop" and len(said) == 1
    assert "per-example loop" in said[0]
    with pytest.raises(NotPerExample, match=r"^mode='vmap' cannot run this model: ") as e:
        PerExampleClipper(model, C, mode="vmap").clipped_sum(x, y)
    one_line_refusal(e)


# -- independence of examples ---------------------------------------------------------------------
@pytest.mark.parametrize("model", [MeanMix, lambda: MeanMix(1e-4), FunctionalBatchNorm])
@pytest.mark.parametrize("mode", ["auto", "ghost", "vmap"])
def test_a_model_that_mixes_examples_is_refused_by_every_engine(model, mode):
    x, y = flat(8)
    with pytest.raises(NotPerExample, match=r"^the model mixes examples: changing ") as e:
        PerExampleClipper(model().to(DT), C, mode=mode).clipped_sum(x, y)
    msg = one_line_refusal(e)
    assert "changed the loss of example" in msg


def test_dropout_is_not_read_as_mixing():
    model = nn.Sequential(nn.Linear(D, H), nn.Dropout(0.5), nn.Tanh(), nn.Linear(H, NCLS)).to(DT)
    x, y = flat(8)
    before = torch.random.get_rng_state()
    clipper = PerExampleClipper(model, C)
    clipper.prove(x, y)
    assert torch.equal(torch.random.get_rng_state(), before)  # the run's RNG untouched
    assert clipper.mode == "ghost"
    model.eval()
    assert_close(
        clipper.clipped_sum(x, y).grads, loop_clipped_sum(model, x, y, clipper.groups, C)[0]
    )


def test_private_trainer_refuses_a_mixing_model_before_any_lot():
    import dpsgd

    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(40, D, generator=g), torch.randint(0, NCLS, (40,), generator=g)
    model = MeanMix()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"^the model mixes examples") as e:
        dpsgd.PrivateTrainer(model, (X, y), lot_size=10, sigma=1.0, threads=False)
    one_line_refusal(e)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_embedding_max_norm_is_refused_in_one_line():
    model = nn.Sequential(nn.Embedding(V, H, max_norm=1.0), nn.Flatten(), nn.Linear(4 * H, NCLS))
    for mode in ("auto", "vmap", "ghost"):
        with pytest.raises(ValueError, match=r"^module '0' \(Embedding\): max_norm=1.0 ") as e:
            PerExampleClipper(model, C, mode=mode)
        one_line_refusal(e)


# -- fallbacks decided at build ------------------------------------------------------------------
class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(V, H), nn.Linear(H, V, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        return self.out(torch.tanh(self.emb(idx)).mean(1))


class BiasKVAttention(nn.Module):
    """nn.MultiheadAttention(add_bias_kv=True): its bias_k, bias_v have no ghost rule."""

    def __init__(self):
        super().__init__()
        self.inp, self.att = nn.Linear(D, H), nn.MultiheadAttention(H, 2, add_bias_kv=True)
        self.head = nn.Linear(H, NCLS)

    def forward(self, x):  # [B, T, D]
        h = self.inp(x).transpose(0, 1)
        return self.head(self.att(h, h, h)[0].mean(0))


def parametrized():
    from torch.nn.utils.parametrizations import weight_norm

    return nn.Sequential(weight_norm(nn.Linear(D, H)), nn.Tanh(), nn.Linear(H, NCLS))


@pytest.mark.parametrize(
    "build, data, named",
    [
        (Tied, lambda: (tokens(6, 4)[0], tokens(6, 4)[1] % V), "'out.weight' is shared with"),
        (parametrized, lambda: flat(6), "owns parameters and has submodules"),
        (BiasKVAttention, lambda: seq(6, 4), "(MultiheadAttention): add_bias_kv=True"),
    ],
)
def test_a_fallback_decided_at_build_is_said_once_with_its_cost(build, data, named):
    x, y = data()
    clipper, said = exact_or_refused(build().to(DT), x, y)
    assert clipper.mode == "vmap" and len(said) == 1
    assert said[0].startswith("ghost clipping cannot run this model: ") and named in said[0]
    assert "it runs on the exact per-example path (vmap)" in said[0]


# -- recurrent layers ----------------------------------------------------------------------------
class Recurrent(nn.Module):
    def __init__(self, kind, batch_first, **kw):
        super().__init__()
        self.batch_first = batch_first
        self.rnn = getattr(nn, kind)(D, H, batch_first=batch_first, **kw)
        width = H if not kw.get("proj_size") else kw["proj_size"]
        self.head = nn.Linear(width * (2 if kw.get("bidirectional") else 1), NCLS)

    def forward(self, x):  # [B, T, D]
        out, _ = self.rnn(x if self.batch_first else x.transpose(0, 1))
        return self.head(out[:, -1] if self.batch_first else out[-1])


@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("B, T", [(5, 4), (5, 5)])
def test_recurrent_layers_are_exact_on_the_ghost_engine(kind, batch_first, B, T):
    model = Recurrent(kind, batch_first).to(DT)
    x, y = seq(B, T)
    for clipping in ("global", "per_layer"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a rule of its own: nothing to say
            clipper, _ = exact_or_refused(model, x, y, clipping=clipping)
        assert clipper.mode == "ghost" and clipper.native


@pytest.mark.parametrize(
    "kind, kw",
    [
        ("RNN", {"num_layers": 2, "nonlinearity": "relu", "bias": False}),
        ("GRU", {"num_layers": 2, "bidirectional": True}),
        ("LSTM", {"num_layers": 2, "bidirectional": True, "proj_size": 3}),
    ],
)
@pytest.mark.parametrize("mode", ["ghost", "vmap"])
def test_recurrent_variants_in_both_engines(kind, kw, mode):
    model = Recurrent(kind, False, **kw).to(DT)
    x, y = seq(6, 4)
    exact_or_refused(model, x, y, mode=mode, clipping="per_layer")


def test_recurrent_layers_with_augmentation_rows():
    model = Recurrent("GRU", True).to(DT)
    x, y = seq(4, 5)
    xk = x.repeat_interleave(2, 0) + 0.1 * torch.randn(8, 5, D, dtype=DT)
    r_g = PerExampleClipper(model, C, mode="ghost").clipped_sum(xk, y, multiplicity=2)
    ref, _ = loop_clipped_sum(model, xk, y, [[n for n, _ in model.named_parameters()]], C, K=2)
    assert_close(r_g.grads, ref)


@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
def test_recurrent_layers_in_float32_match_float64(kind):
    """float32 against the float64 loop: relative error within reduction_rtol(P, EPS32)."""
    from tolerances import EPS32, reduction_rtol

    model = Recurrent(kind, False).to(DT)
    x, y = seq(6, 4)
    ref, _ = loop_clipped_sum(model, x, y, [[n for n, _ in model.named_parameters()]], C)
    res = PerExampleClipper(model.float(), C).clipped_sum(x.float(), y)
    P = sum(t.numel() for t in ref.values())
    assert_close({n: g.to(DT) for n, g in res.grads.items()}, ref, rtol=reduction_rtol(P, EPS32))


def test_a_gru_trains_through_private_trainer():
    import dpsgd

    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(60, 7, D, generator=g), torch.randint(0, NCLS, (60,), generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = dpsgd.PrivateTrainer(
            Recurrent("GRU", True), (X, y), lot_size=20, sigma=1.0, threads=False
        )
        t.fit(1)
    assert t.steps > 0 and t.clipper.mode == "ghost"
