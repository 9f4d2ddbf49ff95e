"""Runs with correlated noise (privacy.noise=bandmf|blt) through the command line's code path: b = 1
is Algorithm 1 bit for bit (weights and ε), b > 1 trains and states its mechanism and valid ε, a
run killed mid-way resumes to the uninterrupted run's weights (the noise sequence continued from the
checkpoint), and a cycle cut by training.max_steps is not continued."""

import pytest
import torch

from conftest import TINY_RUN
from dpsgd.config.schema import validate
from dpsgd.launch.main import compose
from dpsgd.launch.prepare import prepare_resume
from dpsgd.run.checkpoint import load_checkpoint
from dpsgd.train import train
from resume_harness import Harness

ARGS = TINY_RUN + ["privacy.sigma=2", "seed=4", "training.epochs=3"]


def _run(path, *extra):
    args = ARGS + list(extra)
    return train(validate(compose(args)), path, args)


def test_bands_1_is_algorithm_1_bit_for_bit(tmp_path):
    a = _run(tmp_path / "a")
    b = _run(tmp_path / "b", "privacy.noise=bandmf", "privacy.bands=1")
    wa, wb = load_checkpoint(tmp_path / "a")["model"], load_checkpoint(tmp_path / "b")["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a["epsilon_by_accountant"] == b["epsilon_by_accountant"]  # exact: same mechanisms
    assert b["sampling"]["name"] == "cyclic_poisson" and b["correlated_noise"]["independent"]


@pytest.mark.parametrize(
    "extra,sampling",
    [
        (["privacy.noise=bandmf", "privacy.bands=2"], "cyclic_poisson"),
        (["privacy.noise=blt"], "cyclic"),
    ],
)
def test_correlated_run_states_its_mechanism(tmp_path, capsys, extra, sampling):
    st = _run(tmp_path / "r", *extra)
    out = capsys.readouterr().out
    assert st["status"] == "complete" and st["sampling"]["name"] == sampling
    assert "correlated Gaussian noise" in st["mechanism"]
    cn = st["correlated_noise"]
    assert cn["noise"] == extra[0].split("=")[1] and cn["participation"] == sampling
    assert {e["event"] for e in st["ledger"]["entries"]} == {"poisson", "cyclic"}  # PCA, then lots
    assert st["epsilon_valid"] is not None and st["epsilon_valid"] > 0
    first = out.splitlines()
    assert first[1].startswith("noise: ") and f"privacy.sampling={sampling}" in first[1]
    cfg = (tmp_path / "r" / "config.resolved.yaml").read_text()
    assert f"sampling: {sampling}" in cfg  # the schema that ran, in the resolved config


@pytest.mark.parametrize(
    "extra", [["privacy.noise=bandmf", "privacy.bands=3"], ["privacy.noise=blt"]]
)
def test_killed_run_resumes_to_the_uninterrupted_weights(tmp_path, monkeypatch, extra):
    """Killed before its second checkpoint: the resume replays epoch 2 from the checkpoint's
    generators and correlated-noise buffers, and ends where the uninterrupted run ends."""
    ref = tmp_path / "ref"
    _run(ref, *extra)
    h = Harness(monkeypatch, tmp_path / "run")
    args = ["privacy.sigma=2", "seed=4", "training.epochs=3", *extra]
    assert h.fresh(*args, kill=("checkpoint", 2)) is None  # killed
    st = h.resume()
    a, b = load_checkpoint(ref), load_checkpoint(tmp_path / "run")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert (
        a["optimizer"]["correlated"]["step"] == b["optimizer"]["correlated"]["step"] == a["steps"]
    )
    assert st["resumes"][0]["lost_lots_charged"] > 0  # the replayed lots are charged again


def test_a_cycle_cut_by_max_steps_is_not_continued(tmp_path, capsys):
    """A run stopped by training.max_steps mid-cycle is finished: a resume asking for more lots
    does nothing (the sampler would refuse to start an epoch mid-cycle: test_cyclic.py)."""
    run = tmp_path / "r"
    _run(run, "privacy.noise=bandmf", "privacy.bands=3", "training.max_steps=4")
    before = load_checkpoint(run)
    assert before["sampler"]["position"] == 4  # one lot into the second cycle of 3
    c, rd, rest = prepare_resume([f"resume={run}", "training.max_steps=9"])
    train(c, rd, rest)
    assert "nothing to do" in capsys.readouterr().out
    assert load_checkpoint(run)["steps"] == 4
