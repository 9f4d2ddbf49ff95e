"""Speed and memory of ``precision="bf16"`` against float32: one DP step of the engine
(``dpsgd.make_private``) on a small transformer, full fine-tuning.

    python -m bench.bench_precision            # writes results/bench_precision.csv
    python -m bench.bench_precision --quick    # smoke run

The model is a BERT for sequence classification (4 layers, hidden 128, 4 heads, intermediate 512,
vocabulary 1000, random init) on lots of 32 sequences of 64 tokens, global clipping at C = 1,
σ = 1, AdamW. A step is ``engine.step(lot)`` on the same lot (read from memory). Timing: the two
precisions run in one process, in interleaved blocks (the first dropped), the median over blocks
of ms per step, so a drift in the machine's load falls on both. Memory: each precision in a fresh
process: the bytes autograd saves for the backward pass during one step (the activations, the
part of a step's memory that precision changes), and the process's peak resident set
(``ru_maxrss``, dominated by the libraries and the proof's float64 twin at this size). The load average of the machine is recorded beside
the numbers: on a shared CPU they say how bf16 compares there, nothing about a GPU (where bf16
runs on tensor cores; CPUs without AVX512-BF16/AMX emulate it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench import write_csv
from dpsgd.core.runtime import describe_hardware

COLUMNS = ["precision", "model", "lot", "seq", "threads", "step_ms", "ratio_to_fp32",
           "saved_mb", "peak_rss_mb", "reps", "steps_per_rep", "load_avg", "torch",
           "transformers", "hardware"]  # fmt: skip
OUT = Path(__file__).resolve().parents[1] / "results" / "bench_precision.csv"
MODEL = "bert_4x128"


def _engine(precision: str, lot: int, seq: int, seed: int = 0):
    """(engine, the lot it steps): a BERT, a Dataset of dicts, AdamW."""
    import transformers

    import dpsgd

    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, intermediate_size=512,
                                  max_position_embeddings=seq, num_labels=2)  # fmt: skip
    model = transformers.BertForSequenceClassification(cfg)
    g = torch.Generator().manual_seed(seed)
    n = 4 * lot
    ids = torch.randint(1, 1000, (n, seq), generator=g)
    data = [{"input_ids": ids[i], "attention_mask": torch.ones(seq, dtype=torch.long),
             "labels": torch.tensor(i % 2)} for i in range(n)]  # fmt: skip

    def loss(m, b):
        out = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
        return torch.nn.functional.cross_entropy(out.logits, b["labels"], reduction="none")

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = dpsgd.make_private(model, opt, data, lot_size=lot, sigma=1.0, loss=loss, seed=seed,
                                sampling="fixed_size", precision=precision, delta=1e-3)  # fmt: skip
    return engine, next(engine.lots())


def _step(engine, lot) -> None:
    """One step on the same lot, again and again (the lot is re-armed as the pending one)."""
    engine._pending = lot
    engine.step(lot)


def memory(precision: str, lot: int, seq: int, steps: int) -> dict:
    """Run in a fresh process: the bytes autograd saves in one step, and the peak resident set
    after ``steps`` steps."""
    engine, first = _engine(precision, lot, seq)
    _step(engine, first)  # the first call of the signature: its proof runs here, not below
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _step(engine, first)
    for _ in range(steps):
        _step(engine, first)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_rss_mb": peak / 1024, "saved_mb": saved[0] / 2**20}


def timing(lot: int, seq: int, reps: int, steps: int) -> dict:
    """{precision: [ms per step of each block]}, the blocks interleaved."""
    engines = {p: _engine(p, lot, seq) for p in ("fp32", "bf16")}
    for p, (e, first) in engines.items():  # warm up: the proof of the signature, allocator
        _step(e, first)
    times = {p: [] for p in engines}
    for r in range(reps + 1):
        for p, (e, first) in engines.items():
            t = time.perf_counter()
            for _ in range(steps):
                _step(e, first)
            if r:  # the first block dropped
                times[p].append(1000 * (time.perf_counter() - t) / steps)
    return times


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lot", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--memory", default=None, help=argparse.SUPPRESS)  # a child's precision
    a = ap.parse_args(argv)
    if a.quick:
        a.lot, a.seq, a.reps, a.steps = 8, 16, 1, 1
    if a.memory:
        print(json.dumps(memory(a.memory, a.lot, a.seq, a.steps)))
        return []
    import transformers

    load0 = os.getloadavg()[0]
    times = timing(a.lot, a.seq, a.reps, a.steps)
    mem = {}
    for p in times:
        cmd = [sys.executable, "-m", "bench.bench_precision", "--memory", p, "--lot", str(a.lot),
               "--seq", str(a.seq), "--steps", str(a.steps)]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        mem[p] = json.loads(out.stdout.strip().splitlines()[-1])
    load = f"{load0:.2f}-{os.getloadavg()[0]:.2f}"
    fp32 = statistics.median(times["fp32"])
    rows = [
        {"precision": p, "model": MODEL, "lot": a.lot, "seq": a.seq,
         "threads": torch.get_num_threads(), "step_ms": round(statistics.median(t), 1),
         "ratio_to_fp32": round(statistics.median(t) / fp32, 3),
         "saved_mb": round(mem[p]["saved_mb"], 2),
         "peak_rss_mb": round(mem[p]["peak_rss_mb"], 1), "reps": a.reps,
         "steps_per_rep": a.steps, "load_avg": load, "torch": torch.__version__,
         "transformers": transformers.__version__, "hardware": describe_hardware()}
        for p, t in times.items()
    ]  # fmt: skip
    write_csv(rows, Path(a.out), COLUMNS)
    for r in rows:
        print(r)
    return rows


if __name__ == "__main__":
    main()
