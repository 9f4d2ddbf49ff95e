"""The winner's saved model on the real test set: once, after the selection, never used to select.

The test set is not the private training data the selection charges, and it is read only after the
winner is fixed (tuning.json's winner is written first), so this number is a report about the
released model, like the test accuracy of any single run. The model comes from the winner's final
checkpoint (its weights as released; the EMA's when training.ema_decay is set); the data are the
same features and projection the run trained on, with dataset.validation unset so that the held-out
rows are the dataset's test split.
"""

from __future__ import annotations

from pathlib import Path

from dpsgd.config.schema import validate
from dpsgd.data.augment import LotTransform
from dpsgd.run import parts
from dpsgd.run.checkpoint import load_checkpoint
from dpsgd.launch.cli import compose
from dpsgd.run.evaluate import evaluate


def test_accuracy(run_dir: Path, overrides: list[str]) -> float:
    """Accuracy of the run's released weights on the test split of its dataset."""
    ckpt = load_checkpoint(run_dir)
    if ckpt is None or not ckpt["complete"]:
        raise ValueError(f"{run_dir}: no finished checkpoint to evaluate")
    c = validate(
        compose(
            [o for o in overrides if not o.startswith("dataset.validation=")]
            + ["dataset.validation=null"]
        )
    )
    data = parts.project(parts.load_data(c), ckpt["projection"])
    model = parts.init_model(c, data, 0)
    model.load_state_dict(ckpt["model"])
    if ckpt.get("ema") is not None:
        from dpsgd.mechanism.ema import EMA

        ema = EMA(model, c.training.ema_decay)
        ema.load_state_dict(ckpt["ema"])
        with ema.applied(model) as m:
            return _accuracy(c, m, data)
    return _accuracy(c, model, data)


def _accuracy(c, model, data) -> float:
    ds = c.dataset
    tf = LotTransform(ds.augment, ds.standardize, ds.crop, c.seed).eval
    return float(evaluate(model, data.X_test, data.y_test, c.training.eval_batch_size, tf)[1])
