"""RMSNorm in the ghost engine (dpsgd/mechanism/clipping/seq_layers.py): torch's nn.RMSNorm and
the Hugging Face RMSNorm classes (matched by structure) equal the vmap reference and a float64
batch-of-1 loop, pass the proof (mode="ghost" runs only what proof.py proved), and a module that
only looks like an RMSNorm is refused by the proof and runs on the exact path."""

import pytest
import torch
from torch import nn

from dp_reference import assert_close, loop_clipped_sum
from dpsgd.core.errors import NotPerExample
from dpsgd.mechanism.clipping import PerExampleClipper
from dpsgd.mechanism.clipping.layers import GenericLayer, LinearLayer
from dpsgd.mechanism.clipping.registry import registered_rule
from dpsgd.mechanism.clipping.seq_layers import RMSNormLayer, ScaledNormLayer
from tolerances import EPS32, assert_f64_close, f64_rtol, n_params, reduction_rtol

DT = torch.float64
C = 0.05  # every example clipped in some group
D, T = 6, 5


class LlamaStyleRMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm, in the input's dtype (no float32 cast): y = w ⊙ x̂."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, h):
        variance = h.pow(2).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(variance + self.variance_epsilon))


class GemmaStyleRMSNorm(LlamaStyleRMSNorm):
    """Hugging Face's GemmaRMSNorm form: y = (1 + w) ⊙ x̂ (weight initialised at 0)."""

    def forward(self, h):
        out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return out * (1.0 + self.weight)


class SquaredRMSNorm(LlamaStyleRMSNorm):
    """Named like an RMSNorm, but y = w² ⊙ x̂: not affine in w, so ScaledNormLayer's assumption
    fails (the proof must catch it)."""

    def forward(self, h):
        return self.weight.square() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))


class RMSNet(nn.Module):
    """Per-token Linear → norm over D → Linear → nn.RMSNorm over [T, D] (eps=None) → head."""

    def __init__(self, norm=nn.RMSNorm):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.n1 = norm(D)
        self.mix = nn.Linear(D, D)
        self.n2 = nn.RMSNorm((T, D))
        self.head = nn.Linear(T * D, 4)
        with torch.no_grad():  # weights away from their initial 1 (or 0): a gradient that is
            for n in (self.n1, self.n2):  # not the weight's own value
                n.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        h = self.mix(torch.tanh(self.n1(self.inp(x))))
        return self.head(self.n2(torch.tanh(h)).flatten(1))


def data(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, T, D, generator=g, dtype=DT), torch.randint(0, 4, (n,), generator=g)


def test_rules_are_found():
    assert registered_rule(nn.RMSNorm(4)) is RMSNormLayer
    assert registered_rule(LlamaStyleRMSNorm(4)) is ScaledNormLayer
    assert registered_rule(GemmaStyleRMSNorm(4)) is ScaledNormLayer

    class BiasRMSNorm(LlamaStyleRMSNorm):  # a second parameter: not the structure matched
        def __init__(self, d):
            super().__init__(d)
            self.bias = nn.Parameter(torch.zeros(d))

    assert registered_rule(BiasRMSNorm(4)) is None


@pytest.mark.parametrize("norm", [nn.RMSNorm, LlamaStyleRMSNorm, GemmaStyleRMSNorm])
@pytest.mark.parametrize("clipping", ["global", "per_layer"])
@pytest.mark.parametrize("budget", [0, 2**30])
def test_ghost_equals_vmap_and_loop(norm, clipping, budget):
    torch.manual_seed(0)
    model = RMSNet(norm).to(DT)
    x, y = data()
    ghost = PerExampleClipper(model, C, clipping, "ghost", memory_budget_bytes=budget)
    kinds = [type(l) for l in ghost._layers]
    assert kinds.count(RMSNormLayer) == (2 if norm is nn.RMSNorm else 1) and ghost.native
    r_g = ghost.clipped_sum(x, y)  # mode="ghost": runs only after the proof passed
    assert ghost.mode == "ghost"
    r_v = PerExampleClipper(model, C, clipping, "vmap").clipped_sum(x, y)
    ref, ref_norms = loop_clipped_sum(model, x, y, ghost.groups, C)
    assert_close(r_g.grads, ref)
    assert_close(r_v.grads, ref)
    assert_f64_close(r_g.norms, ref_norms, f64_rtol(model))
    assert (ref_norms > C).any()


def test_augmentation_rows_are_summed_per_example():
    torch.manual_seed(1)
    model = RMSNet(LlamaStyleRMSNorm).to(DT)
    x, y = data(4, 1)
    xk = x.repeat_interleave(2, 0) + 0.1 * torch.randn(8, T, D, dtype=DT)  # K = 2 rows each
    r = PerExampleClipper(model, C, "global", "ghost").clipped_sum(xk, y, multiplicity=2)
    ref, ref_norms = loop_clipped_sum(
        model, xk, y, [[n for n, _ in model.named_parameters()]], C, 2
    )
    assert_close(r.grads, ref)
    assert_f64_close(r.norms, ref_norms, f64_rtol(model))


def test_a_norm_not_affine_in_its_weight_is_refused_by_the_proof():
    torch.manual_seed(2)
    model = RMSNet(SquaredRMSNorm).to(DT)
    x, y = data()
    ghost = PerExampleClipper(model, C, "global", "ghost")
    assert ScaledNormLayer in [type(l) for l in ghost._layers]  # matched by its name and weight
    with pytest.raises(NotPerExample, match="n1.weight"):
        ghost.clipped_sum(x, y)
    with pytest.warns(UserWarning, match="n1.weight"):
        auto = PerExampleClipper(model, C, "global", "auto")
        r = auto.clipped_sum(x, y)
    assert auto.mode == "ghost+vmap"
    ref, _ = loop_clipped_sum(model, x, y, auto.groups, C)
    assert_close(r.grads, ref)


def test_frozen_norm_weight_is_no_layer():
    model = RMSNet().to(DT)
    model.n1.weight.requires_grad_(False)
    ghost = PerExampleClipper(model, C, "per_layer", "ghost")
    assert [type(l) for l in ghost._layers].count(RMSNormLayer) == 1
    assert not any(isinstance(l, GenericLayer) for l in ghost._layers)


class Logits(nn.Module):
    """A Hugging Face model's ``.logits`` as a tensor (the clipper's model(x) -> logits)."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, ids):
        return self.m(input_ids=ids).logits


def test_hugging_face_llama_runs_on_ghost_rules_exactly():
    """A tiny random-init LlamaForSequenceClassification (Embedding, Linear attention and MLP,
    LlamaRMSNorm): every layer on a native rule, the proof passed, equal to a float64 batch-of-1
    loop. LlamaRMSNorm casts to float32 inside, so the gradients below each norm carry float32
    round-off: the tolerance is n·eps of float32 (the proof's own, proof.py:_rtol)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=3,
        pad_token_id=0,
        attn_implementation="eager",
    )
    torch.manual_seed(3)
    model = Logits(transformers.LlamaForSequenceClassification(cfg)).to(DT)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "LlamaRMSNorm":
                m.weight.uniform_(0.5, 1.5)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(1, 40, (6, 7), generator=g), torch.randint(0, 3, (6,), generator=g)
    ghost = PerExampleClipper(model, 0.5, "global", "ghost")
    kinds = [type(l) for l in ghost._layers]
    assert ghost.native and kinds.count(ScaledNormLayer) == 3 and LinearLayer in kinds
    r = ghost.clipped_sum(x, y)
    ref, ref_norms = loop_clipped_sum(model, x, y, ghost.groups, 0.5)
    rtol = reduction_rtol(n_params(model), EPS32)
    assert_close(r.grads, ref, rtol)
    assert_f64_close(r.norms, ref_norms, rtol)
