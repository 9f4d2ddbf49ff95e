"""Models from ``transformers`` (an optional extra; CI installs it): dict batches with attention
masks, sequence losses averaged per example over a padding mask, each model's clipped sum equal to
a float64 batch-of-1 loop, and which engine runs which model (and why).

Hugging Face attention is built from Linear layers, so a BERT runs wholly on ghost norms (its
position embeddings, one row the batch shares, expanded to the examples: ghost.py ``Capture``). A
layer without a rule (GPT-2's Conv1D, Llama's RMSNorm) takes the per-module vmap; tied input and
output embeddings (GPT-2's default, BERT's MLM head, whose prediction head also owns a parameter
beside its submodules) put the whole model on the exact path, and since Hugging Face's mask
builders branch on the mask's values (``padding_mask.all()``), which vmap cannot, on the
per-example loop. Nothing is downloaded (HF_HUB_OFFLINE=1; a pretrained model is one this test
writes with ``save_pretrained``).
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from dpsgd.mechanism.batches import BatchLoss, token_losses  # noqa: E402
from dpsgd.mechanism.clipping import PerExampleClipper  # noqa: E402
from tolerances import EPS32, EPS64, n_params, reduction_rtol  # noqa: E402

V, B, T = 40, 9, 6


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 4:], mask[3, 2:] = 0, 0  # padded examples
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100),
            "y": torch.randint(0, 3, (B,), generator=g)}  # fmt: skip


def cls_loss(model, b):
    out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
    return torch.nn.functional.cross_entropy(out.logits, b["y"], reduction="none")


def lm_loss(model, b):  # a causal LM: token t predicts t + 1, padding ignored
    out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
    return token_losses(out.logits, b["labels"], shift=True)


def mlm_loss(model, b):
    out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
    return token_losses(out.logits, b["labels"])


def bert():
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=16, num_labels=3)  # fmt: skip
    return transformers.BertForSequenceClassification(cfg)


def bert_mlm():
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=16)  # fmt: skip
    return transformers.BertForMaskedLM(cfg)


def gpt2(tied: bool):
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                  tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def llama():
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=16,
                                   bos_token_id=0, eos_token_id=0)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def loop_clipped_sum(model, loss, batch, C):
    """Algorithm 1 read literally: each example alone through the model (a batch of one, its
    padding as it is), its gradient by autograd, clipped to C, summed."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sums = {n: torch.zeros_like(p) for n, p in named}
    for i in range(B):
        one = {k: v[i : i + 1] for k, v in batch.items()}
        g = torch.autograd.grad(loss(model, one)[0], [p for _, p in named], allow_unused=True)
        g = [torch.zeros_like(p) if t is None else t for (_, p), t in zip(named, g)]
        norm = torch.sqrt(sum(t.pow(2).sum() for t in g))
        for (n, _), t in zip(named, g):
            sums[n] += t * min(1.0, C / float(norm))
    return sums


CASES = {  # model, loss, the engine that runs it, the eps of its least precise arithmetic
    "bert": (bert, cls_loss, "ghost", EPS64),
    "gpt2": (lambda: gpt2(False), lm_loss, "ghost", EPS64),  # Conv1D: per-module vmap
    "gpt2_tied": (lambda: gpt2(True), lm_loss, "loop", EPS64),  # wte = lm_head: exact path
    "llama": (llama, lm_loss, "ghost", EPS32),  # RMSNorm computes in float32: per-module vmap
    "bert_mlm": (bert_mlm, mlm_loss, "loop", EPS64),  # tied; a head owning a bias + submodules
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_model_clips_as_a_float64_batch_of_one_loop(name):
    make, loss, engine, eps = CASES[name]
    torch.manual_seed(0)
    model = make().double()
    for m in model.modules():  # the loop and the batch must draw the same (no) dropout
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    batch, C = _batch(), 0.5
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        clipper = PerExampleClipper(model, C, loss=BatchLoss(loss))
        got = clipper.clipped_sum(batch)
    ref = loop_clipped_sum(model, loss, batch, C)
    assert clipper.mode == engine, [str(w.message) for w in said]
    rtol = reduction_rtol(n_params(model), eps)  # values reduced over at most P terms
    scale = max(float(t.norm()) for t in ref.values())
    for n, t in ref.items():
        assert float((got.grads[n] - t).norm()) <= rtol * (float(t.norm()) + scale), n
    assert bool((got.norms[:, 0] > C).any())  # some examples were clipped


def test_a_padded_example_clips_as_it_would_unpadded():
    """The padding mask and the per-example token mean: example 0, padded from 4 to 6 tokens,
    has the gradient norm it has when given alone without its padding."""
    torch.manual_seed(0)
    model = bert().double().eval()
    batch = _batch()
    clipper = PerExampleClipper(model, 1.0, loss=BatchLoss(cls_loss))
    norms = clipper.clipped_sum(batch).norms[:, 0]
    alone = {k: (v[:1, :4] if v.dim() == 2 else v[:1]) for k, v in batch.items()}
    g = torch.autograd.grad(cls_loss(model, alone)[0], list(model.parameters()), allow_unused=True)
    ref = torch.sqrt(sum(t.pow(2).sum() for t in g if t is not None))
    assert abs(float(norms[0] - ref)) <= reduction_rtol(n_params(model)) * float(ref)


def test_from_pretrained_on_a_local_folder_through_the_api(tmp_path):
    import dpsgd

    torch.manual_seed(0)
    bert().save_pretrained(tmp_path / "bert")  # nothing downloaded: the folder this test wrote
    model = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "bert")
    batch = _batch()
    data = [{k: v[i] for k, v in batch.items()} for i in range(B)] * 8
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    e = dpsgd.make_private(model, opt, data, lot_size=12, sigma=1.0, epochs=1, loss=cls_loss,
                           seed=0, delta=1e-3)  # fmt: skip
    for lot in e.lots():
        e.step(lot)
    assert e.steps == 6 and e.clipper.mode == "ghost" and e.ledger.entries[0].count == 6


@pytest.mark.slow
def test_the_command_line_trains_a_transformers_model_by_its_target(tmp_path):
    """``model._target_``: random init from a config (Hydra builds the nested config), and
    ``from_pretrained`` on a local folder; token ids through ``dataset.dtype=int64``."""
    from dpsgd.config.schema import validate
    from dpsgd.launch.main import compose
    from dpsgd.train import train

    g = torch.Generator().manual_seed(0)
    X, y = torch.randint(1, V, (240, T), generator=g), torch.randint(0, 3, (240,), generator=g)
    torch.save((X[:200], y[:200]), tmp_path / "train.pt")
    torch.save((X[200:], y[200:]), tmp_path / "test.pt")
    bert().save_pretrained(tmp_path / "bert")
    common = ["model=custom", "dataset=tensors", f"dataset.train={tmp_path / 'train.pt'}",
              f"dataset.test={tmp_path / 'test.pt'}", "dataset.dtype=int64", "device=cpu",
              "privacy.lot_size=40", "privacy.target_epsilon=4", "training.epochs=2",
              "privacy.delta=1e-3", "optimizer=adamw", "training.lr=1e-3"]  # fmt: skip
    config = ["model._target_=transformers.BertForSequenceClassification",
              "+model.args.config._target_=transformers.BertConfig",
              f"+model.args.config.vocab_size={V}", "+model.args.config.hidden_size=16",
              "+model.args.config.num_hidden_layers=1", "+model.args.config.num_attention_heads=2",
              "+model.args.config.intermediate_size=32", "+model.args.config.num_labels=3"]  # fmt: skip
    folder = ["model._target_=transformers.BertForSequenceClassification.from_pretrained",
              f"+model.args.pretrained_model_name_or_path={tmp_path / 'bert'}"]  # fmt: skip
    for i, model in enumerate((config, folder)):
        args = [*common, *model]
        c = validate(compose(args))
        assert c.privacy.calibrate_sigma and c.accountant.name == "pld"  # σ from the target ε
        out = train(c, tmp_path / f"run{i}", args)
        st = json.loads((tmp_path / f"run{i}" / "privacy.json").read_text())
        assert out["status"] == "complete" and st["steps"] == 10
        assert st["epsilon_valid"] <= 4.0
