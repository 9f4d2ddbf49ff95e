"""EMA of the weights (dpsgd/mechanism/ema.py): the decay math against the closed form, the state
round trip, config validation, and a resumed run equal to an uninterrupted one (EMA restored from
the checkpoint)."""

import pytest
import torch
from torch import nn

from conftest import metrics_row_count, metrics_rows
from dpsgd.run.checkpoint import load_checkpoint
from dpsgd.config.schema import ConfigError, validate
from dpsgd.mechanism.ema import EMA
from dpsgd.launch.main import compose
from dpsgd.launch.prepare import prepare_resume
from dpsgd.train import train
from tolerances import assert_f64_close, chain_rel_tol


def test_decay_math_is_the_closed_form():
    """θ̄_T = β^T θ_0 + (1 − β) Σ_t β^(T−t) θ_t for iterates θ_1 .. θ_T (float64)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    beta, thetas = 0.9, [{n: v.clone() for n, v in model.state_dict().items()}]
    ema = EMA(model, beta)
    for _ in range(7):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        thetas.append({n: v.clone() for n, v in model.state_dict().items()})
        ema.update(model)
    T = len(thetas) - 1
    for n in ema.shadow:
        closed = beta**T * thetas[0][n] + sum(
            (1 - beta) * beta ** (T - t) * thetas[t][n] for t in range(1, T + 1)
        )
        # T recursive updates against a closed form of T + 1 terms: a few float64 ops per term
        assert_f64_close(ema.shadow[n], closed, chain_rel_tol(4 * (T + 1)))
    assert ema.updates == T


def test_applied_swaps_in_and_restores():
    model = nn.Linear(3, 2)
    ema = EMA(model, 0.5)
    own = {n: v.clone() for n, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(model)
    trained = {n: v.clone() for n, v in model.state_dict().items()}
    with ema.applied(model) as m:
        # float32 EMA of two steps: a few eps32 (1.2e-7) of values ~1
        torch.testing.assert_close(m.weight.detach(), own["weight"] + 0.5, rtol=1e-6, atol=1e-6)
    assert all(torch.equal(v, trained[n]) for n, v in model.state_dict().items())


def test_state_round_trip_and_mismatch():
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    ema = EMA(a, 0.99)
    ema.update(a)
    other = EMA(b, 0.99)
    other.load_state_dict(ema.state_dict())
    assert other.updates == 1 and all(
        torch.equal(other.shadow[n], ema.shadow[n]) for n in ema.shadow
    )
    with pytest.raises(ValueError, match="ema_decay"):
        EMA(b, 0.9).load_state_dict(ema.state_dict())
    with pytest.raises(ValueError, match="ema_decay"):
        EMA(b, 1.0)


@pytest.mark.parametrize(
    "value,message",
    [(0, "must be > 0"), (1, "must be < 1"), (1.5, "must be < 1"), ("x", "must be a number")],
)
def test_config_refuses_bad_decay(value, message):
    with pytest.raises(ConfigError, match=f"training.ema_decay=.*{message}"):
        validate({"training": {"ema_decay": value}})
    assert validate({"training": {"ema_decay": 0.999}}).training.ema_decay == 0.999
    assert validate({}).training.ema_decay is None


ARGS = [
    "dataset.subset=1200",
    "privacy.lot_size=200",
    "model.hidden=[50]",
    "privacy.sigma=2",
    "device=cpu",
    "seed=4",
    "training.ema_decay=0.8",
    "privacy.augment_multiplicity=2",
]


def test_resumed_run_equals_uninterrupted_with_ema(tmp_path):
    """A run checkpointed after epoch 1 and resumed to epoch 3 ends with the very same model, EMA
    and metrics as one that ran 3 epochs straight (the EMA comes back from the checkpoint)."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    train(validate(compose([*ARGS, "training.epochs=3"])), ref, [*ARGS, "training.epochs=3"])
    train(validate(compose([*ARGS, "training.epochs=1"])), run, [*ARGS, "training.epochs=1"])
    c, rd, rest = prepare_resume([f"resume={run}", "training.epochs=3"])
    assert c.training.ema_decay == 0.8 and c.privacy.augment_multiplicity == 2
    train(c, rd, rest)
    a, b = load_checkpoint(ref), load_checkpoint(run)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["ema"]["updates"] == b["ema"]["updates"] == 18
    assert all(
        torch.equal(a["ema"]["weights"][k], b["ema"]["weights"][k]) for k in a["ema"]["weights"]
    )
    for col in ("steps", "epsilon", "test_accuracy", "train_loss", "lot_loss"):
        assert [r[col] for r in metrics_rows(ref)] == [r[col] for r in metrics_rows(run)], col
    # the EMA cannot be switched or changed on resume (it is in the fingerprint)
    for bad in ("training.ema_decay=0.9", "privacy.augment_multiplicity=3"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            prepare_resume([f"resume={run}", "training.epochs=4", bad])


def test_ema_and_augmult_enter_the_fingerprint():
    """Every configuration key is compared on resume unless allowed (default deny): EMA and K
    too."""
    from dpsgd.config.fingerprint import config_fingerprint

    fp = config_fingerprint(validate({}))
    assert (
        fp["model.norm"] == "none"
        and fp["privacy.augment_multiplicity"] == 1
        and fp["training.ema_decay"] is None
    )
    fp = config_fingerprint(
        validate({"training": {"ema_decay": 0.9}, "privacy": {"augment_multiplicity": 2}})
    )
    assert fp["training.ema_decay"] == 0.9 and fp["privacy.augment_multiplicity"] == 2


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted_run_with_ema_and_augmult(tmp_path):
    """As tests/e2e/test_resume.py, with EMA and K = 2: a SIGKILL'd and resumed run ends
    bit-identical."""
    import signal
    import time
    from conftest import run_train as _run, start_train as _start_and_wait

    args = [*ARGS, "training.epochs=6"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    train(validate(compose(args)), ref, args)
    proc = _start_and_wait([*args, f"hydra.run.dir={run}"], tmp_path, run, rows=2)
    time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert metrics_row_count(run) < 6
    r = _run([f"resume={run}"], tmp_path)
    assert r.returncode == 0, r.stderr
    a, b = load_checkpoint(ref), load_checkpoint(run)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(
        torch.equal(a["ema"]["weights"][k], b["ema"]["weights"][k]) for k in a["ema"]["weights"]
    )
    assert [r["test_accuracy"] for r in metrics_rows(ref)] == [
        r["test_accuracy"] for r in metrics_rows(run)
    ]
