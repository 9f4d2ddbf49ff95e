"""experiments/finetune.py and friends: the ViT runs on the ghost engine exactly, the plan runs ε = 2
first and tunes only on held-out training examples, one run per engine on the same lots gives rows
of the same charge, the table and figure come from rows alone, and (slow) the whole pipeline runs in
tiny settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from dp_reference import assert_close, loop_clipped_sum
from dpsgd.mechanism.clipping import PerExampleClipper
from dpsgd.mechanism.clipping.layers import LinearLayer
from dpsgd.mechanism.clipping.seq_layers import EmbeddingLayer, LayerNormLayer
from experiments import finetune, finetune_figure
from experiments.finetune_model import ViT, n_params
from experiments.finetune_runs import build, load, run
from tolerances import assert_f64_close, f64_rtol

REPO = Path(__file__).resolve().parents[2]


def test_the_vit_runs_on_native_ghost_rules_exactly():
    torch.manual_seed(0)
    model = ViT(dim=16, depth=1, heads=2, mlp_dim=24).to(torch.float64)
    assert n_params(ViT()) == 138_890  # the experiment's size (docs/FINETUNE.md)
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(6, 784, generator=g, dtype=torch.float64), torch.randint(0, 10, (6,))
    ghost = PerExampleClipper(model, 0.05, "global", "ghost")  # the proof passes, or it raises
    kinds = {type(l) for l in ghost._layers}
    assert ghost.native and kinds == {LinearLayer, EmbeddingLayer, LayerNormLayer}
    r = ghost.clipped_sum(x, y)
    ref, norms = loop_clipped_sum(model, x, y, ghost.groups, 0.05)
    assert_close(r.grads, ref)
    assert_f64_close(r.norms, norms, f64_rtol(model))


def test_the_plan_runs_eps_2_first_and_opacus_after_each_eps():
    lrs = {v: 0.1 for v in finetune.LR_GRID}
    jobs = finetune.main_jobs(("full", "head"), (2.0, 1.0), (0, 1), lrs, ("full",))
    assert [(j["eps"], j["engine"], j["variant"], j["seed"]) for j in jobs] == [
        (2.0, "dpsgd", "full", 0),
        (2.0, "dpsgd", "head", 0),
        (2.0, "dpsgd", "full", 1),
        (2.0, "dpsgd", "head", 1),
        (2.0, "opacus", "full", 0),
        (1.0, "dpsgd", "full", 0),
        (1.0, "dpsgd", "head", 0),
        (1.0, "dpsgd", "full", 1),
        (1.0, "dpsgd", "head", 1),
        (1.0, "opacus", "full", 0),
    ]
    assert len({j["tag"] for j in jobs}) == len(jobs)
    tune = finetune.tuning_jobs(("full", "lora"))
    assert {j["split"] for j in tune} == {"val"} and len(tune) == 6  # never the test set


def test_the_learning_rate_chosen_is_the_best_on_held_out_examples(tmp_path):
    for lr, acc in ((0.03, 0.91), (0.1, 0.95), (0.3, 0.95)):
        d = tmp_path / "runs" / "finetune" / "val" / f"dpsgd_full_eps2_seed0_lr{lr}"
        d.mkdir(parents=True)
        (d / "result.json").write_text(json.dumps({"variant": "full", "lr": lr, "accuracy": acc}))
    assert finetune.chosen_lr(tmp_path, ["full"]) == {"full": 0.1}  # a tie: the smaller


def test_held_out_split_is_disjoint_from_training():
    X, y, Xv, yv = load("val", subset=None)
    assert len(X) == 50_000 and len(Xv) == 10_000
    Xt, _, Xtest, _ = load("test")
    assert len(Xt) == 60_000 and len(Xtest) == 10_000
    seen = {hash(r.numpy().tobytes()) for r in X[:2000]}  # spot check: no held-out image trains
    assert not any(hash(r.numpy().tobytes()) in seen for r in Xv[:2000] if r.any())


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    path = tmp_path_factory.mktemp("ft") / "pre.pt"
    torch.manual_seed(0)
    torch.save(ViT().state_dict(), path)
    return path


def _job(pretrained, variant="head", engine="dpsgd"):
    return {
        **finetune.job(variant, 2.0, 0, 0.5, engine=engine, tiny=True, pretrained=pretrained),
        "subset": 500,
        "lot": 100,
    }


def test_head_only_runs_and_leaves_the_backbone_bit_identical(pretrained):
    before = build("head", 0, pretrained).state_dict()
    row = run(_job(pretrained), log=lambda s: None)
    assert row["mode"] == "ghost" and row["trainable_params"] == 650 and row["steps"] == 5
    assert 0 < row["epsilon"] <= 2.0 and row["q"] == 0.2 and row["train_seconds"] > 0
    after = torch.load(pretrained, weights_only=True)
    assert all(torch.equal(before[k], after[k]) for k in after if not k.startswith("head."))


def test_opacus_runs_the_same_lots_at_the_same_charge(pretrained):
    pytest.importorskip("opacus")
    ours = run(_job(pretrained, "full"), log=lambda s: None)
    theirs = run(_job(pretrained, "full", "opacus"), log=lambda s: None)
    for k in ("steps", "sigma", "epsilon", "N", "lot_size", "trainable_params"):
        assert ours[k] == theirs[k], k  # the same lots, σ and accountant: the same ε (exact)
    assert theirs["mode"] == "opacus-hooks"


def _rows():
    rows = []
    for engine, variants in (("dpsgd", ("full", "lora", "head", "scratch")), ("opacus", ("full",))):
        for v in variants:
            for eps in (1.0, 2.0, 8.0):
                for seed in (0, 1) if engine == "dpsgd" else (0,):
                    rows.append(
                        dict.fromkeys(finetune.COLUMNS)
                        | {
                            "variant": v,
                            "engine": engine,
                            "epsilon_target": eps,
                            "seed": seed,
                            "accuracy": 0.9 + eps / 100 + seed / 1000,
                            "epsilon": eps * 0.999,
                            "sigma": 1.0,
                            "epochs": 5.0,
                            "lr": 0.1,
                            "trainable_params": 650 if v == "head" else 138_890,
                            "seconds_per_epoch": 30.0 if engine == "dpsgd" else 60.0,
                            "train_peak_mb": 100.0,
                            "max_rss_mb": 1400.0,
                            "hardware": "AMD EPYC, 2 cores (shared)",
                        }
                    )
    return pd.DataFrame(rows)


def test_table_and_figure_from_rows(tmp_path):
    df = _rows()
    table = finetune_figure.table_rows(df)
    assert sum(line.startswith("| dpsgd | full fine-tuning | 2 |") for line in table) == 1
    assert any("| opacus | full fine-tuning | 8 | 98.00 % (1)" in line for line in table)
    assert any("| dpsgd | head only | 1 | 91.05 ± 0.07 % (2)" in line for line in table)
    paths = finetune_figure.draw(df, tmp_path / "figures")
    assert all(p.is_file() for p in paths)


@pytest.mark.slow
def test_the_whole_pipeline_in_tiny_settings(tmp_path):
    pytest.importorskip("opacus")
    pytest.importorskip("peft")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = ["--tiny", "--out", str(tmp_path / "out"), "--results", str(tmp_path / "results")]
    args += ["--variants", "full", "lora", "head", "scratch", "--eps", "2", "--seeds", "0"]
    subprocess.run([sys.executable, "-m", "experiments.finetune", *args], cwd=REPO, env=env,
                   check=True)  # fmt: skip
    df = pd.read_csv(tmp_path / "results" / "finetune.csv")
    assert len(df) == 5 and set(df["engine"]) == {"dpsgd", "opacus"}
    assert (df["epsilon"] <= 2.0).all() and (df["max_rss_mb"] > 0).all()
    tuning = pd.read_csv(tmp_path / "results" / "finetune_tuning.csv")
    assert tuning["chosen"].sum() == 4
    assert (tmp_path / "results" / "figures" / "finetune.png").is_file()
