"""The examples in examples/ run as a user runs them, on a small size, and claim what they spent."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cnn_on_tensors_stops_within_its_target(capsys):
    s = _load("cnn_on_tensors").main(["--n", "200", "--epochs", "2", "--epsilon", "3"])
    assert s["steps"] == 40 and s["epsilon"] <= 3.0 and s["groups"] == 1
    assert "epochs_completed: 40 lots" in capsys.readouterr().out


def test_tabular_csv_trains_from_a_label_column(tmp_path, capsys):
    s = _load("tabular_csv").main(["--make", str(tmp_path / "t.csv"), "--epochs", "1"])
    assert s["accountant"] == "pld" and s["steps"] == 30 and math.isfinite(s["epsilon"])
    assert 0.0 <= s["train_accuracy"] <= 1.0 and "(pld)" in capsys.readouterr().out


def test_a_wrong_label_column_is_named(tmp_path):
    m = _load("tabular_csv")
    m.make_csv(str(tmp_path / "t.csv"), n=50)
    with pytest.raises(KeyError, match="label"):
        m.main([str(tmp_path / "t.csv"), "--label", "label"])


def test_a_users_loop_fine_tunes_bert_with_lora_adamw_bf16_to_a_stated_epsilon(tmp_path, capsys):
    """The issue's "done when": a user's loop with AdamW over a Dataset of dicts fine-tunes a
    transformers BERT with LoRA (peft), in bf16, to a stated ε, every lot charged; the frozen
    base never moves; the base comes from a local folder written here (nothing downloaded)."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    m = _load("finetune_bert_lora")
    m.bert().save_pretrained(tmp_path / "bert")
    s = m.main(["--n", "256", "--epochs", "2", "--lot-size", "32", "--epsilon", "3",
                "--pretrained", str(tmp_path / "bert")])  # fmt: skip
    assert s["steps"] == s["charges"] == 16 and s["epsilon"] <= 3.0  # one charge per lot
    assert s["precision"] == "bf16" and s["optimizer"] == "AdamW" and s["accountant"] == "pld"
    assert s["moved"] == [] and s["mode"] == "ghost"  # LoRA exact under ghost norms
    assert "epochs_completed: 16 lots, 16 charged" in capsys.readouterr().out


def test_the_api_page_shows_the_fine_tuning_example_as_it_runs():
    """docs/API.md's loop is the example's, line for line (the example runs above)."""
    page = (EXAMPLES.parent / "docs" / "API.md").read_text(encoding="utf-8")
    block = page.split("<!-- examples/finetune_bert_lora.py -->", 1)[1].split("```python\n", 1)[1]
    block = block.split("```", 1)[0]
    source = (EXAMPLES / "finetune_bert_lora.py").read_text(encoding="utf-8")
    for line in block.splitlines():
        if line.strip() and not line.lstrip().startswith("..."):
            assert line.strip() in source, line
