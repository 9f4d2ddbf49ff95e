"""Private fine-tuning in your own loop: a ``transformers`` BERT with LoRA adapters (``peft``),
AdamW, bf16, over a ``Dataset`` of dicts, to a stated ε (docs/API.md, "Your own loop").

    python examples/finetune_bert_lora.py [--epsilon 3] [--epochs 3] [--n 1024] [--pretrained DIR]

The model is a tiny BERT, randomly initialised from a config or loaded with ``from_pretrained``
from a local folder (nothing is downloaded); the data are toy "sentences" of token ids, tokenized
lazily by the Dataset, each example a dict (input_ids, attention_mask, labels) of its own length
padded to 16. Only the LoRA adapters and the classifier head train: the frozen weights are not
clipped, noised or charged, and never move. Needs ``pip install 'dpsgd[transformers]'``.
"""

from __future__ import annotations

import argparse

import torch
from peft import LoraConfig, get_peft_model
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification

import dpsgd

VOCAB, SEQ = 64, 16


class Sentences(Dataset):
    """n examples, each read when asked for: a dict of tensors. The label says whether token 5
    occurs more often than token 6 in the sentence; padding (id 0) is masked out."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(6, SEQ + 1, (n,), generator=g)
        self.seeds = torch.randint(0, 2**31, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(int(self.seeds[i]))
        n = int(self.lengths[i])
        ids = torch.zeros(SEQ, dtype=torch.long)
        ids[:n] = torch.randint(1, VOCAB, (n,), generator=g)
        label = int((ids == 5).sum() > (ids == 6).sum())
        mask = (torch.arange(SEQ) < n).long()
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor(label)}


def loss(model, batch):
    """Each example's loss ([B]): the model called as it wants, its logits against the labels."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return torch.nn.functional.cross_entropy(out.logits, batch["labels"], reduction="none")


def bert(pretrained: str | None = None):
    """A tiny BERT for two classes: from a local folder, or randomly initialised."""
    if pretrained:
        return BertForSequenceClassification.from_pretrained(pretrained, num_labels=2)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=SEQ, num_labels=2)  # fmt: skip
    return BertForSequenceClassification(cfg)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epsilon", type=float, default=3.0)
    ap.add_argument("--epochs", type=float, default=3)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--lot-size", type=int, default=64)
    ap.add_argument("--pretrained", default=None, help="a local folder (save_pretrained)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    base = bert(args.pretrained)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"],
                      modules_to_save=["classifier"])  # fmt: skip
    model = get_peft_model(base, lora)  # the base frozen: only the adapters and the head train
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    data = Sentences(args.n)
    engine = dpsgd.make_private(
        model, optimizer, data, lot_size=args.lot_size, target_epsilon=args.epsilon,
        epochs=args.epochs, loss=loss, precision="bf16", seed=0,
    )  # fmt: skip
    for lot in engine.lots():  # your loop: schedules, evaluation, logging between the steps
        engine.step(lot)
    s = engine.statement()
    moved = [n for n, p in model.named_parameters() if not p.requires_grad
             and not torch.equal(p, frozen[n])]  # fmt: skip
    charges = sum(e["count"] for e in s["ledger"]["entries"])
    print(f"{engine.stop_reason}: {s['steps']} lots, {charges} charged, ε = {s['epsilon']:.3f} "
          f"(δ = {s['delta']:g}, {s['accountant']}), σ = {s['sigma']:.3f}, "
          f"{len(frozen)} frozen tensors unmoved: {not moved}")  # fmt: skip
    return {**s, "charges": charges, "moved": moved, "mode": engine.clipper.mode}


if __name__ == "__main__":
    main()
