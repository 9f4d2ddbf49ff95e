"""The privacy statement leads with the valid guarantee (min over valid accountants, joint
convention); the configured value is labelled beside it; refusing accountants are skipped; diverged
runs claim nothing for a model. In-process, a small ledger, no training."""

import math
import random
from decimal import Decimal
from types import SimpleNamespace

import mpmath
import pytest
import torch

from dpsgd.accountant import Ledger
from dpsgd.accountant.events import Gaussian, Poisson
from dpsgd.config.schema import validate
from dpsgd.mechanism.noise import GaussianNoise
from dpsgd.mechanism.plan import Plan
from dpsgd.run.report import (
    COLUMNS,
    STATUSES,
    eps_up,
    epsilons,
    final_line,
    metrics_row,
    privacy_statement,
    progress_line,
)
from dpsgd.mechanism.sampling import make_sampler

DELTA = 1e-5
K = 2  # per-layer clipping of the paper's MLP: two groups


def _cfg(**privacy):
    accountant = privacy.pop("accountant", "moments")
    return validate({"privacy": privacy, "accountant": {"name": accountant}})


def _ledger(cls=Ledger):
    led = cls()
    led.record(Gaussian(7.0), 1, "pca")  # DP-PCA release
    led.record(Poisson(0.01, 4.0, K), 300, "sgd")  # 300 lots at q = 0.01
    return led


@pytest.fixture(scope="module")
def paper():
    """The paper's accounting (moments, per_tensor) on a 301-release ledger."""
    c = _cfg(convention="per_tensor")
    led = _ledger()
    return c, led, epsilons(led, c)


def _run(c, led, eps, steps=300):
    """The run state the report reads (dpsgd/run/state.py: Run's progress and parts have these
    attributes; the plan as dpsgd/run/parts.py:build makes it from ``c``)."""
    p = c.privacy
    progress = SimpleNamespace(ledger=led, eps=eps, steps=steps, epoch=3, resumes=[])
    sampler = make_sampler("poisson", 60_000, 600, torch.Generator().manual_seed(0))
    plan = Plan(sampler.event(p.sigma, K) if p.private else None, p.clip_norm, p.lot_size, sampler)
    parts = SimpleNamespace(
        sampler=sampler,
        plan=plan,
        k=K,
        noise=GaussianNoise(seed=0),
        runtime=None,
        clipper=SimpleNamespace(mode="ghost"),
        dp=SimpleNamespace(engine="ghost" if p.private else "plain"),
    )
    return SimpleNamespace(progress=progress, parts=parts)


def _statement(c, led, eps, status="complete", stop_reason="epochs_completed", steps=300):
    return privacy_statement(c, _run(c, led, eps, steps), status, stop_reason)


def _row(c, eps):
    return metrics_row(c, _run(c, None, eps), 0.1, 0.5, (0.4, 0.9, 0.9), 1.0, 3.0)


def test_valid_epsilon_is_the_min_over_valid_accountants_under_the_joint_convention(paper):
    c, led, eps = paper
    joint = {
        a: led.epsilon(DELTA, accountant=a, convention="joint")[0]
        for a in ("moments", "rdp", "pld")
    }
    best = min(joint, key=joint.get)
    assert eps["valid_accountant"] == best == "pld"  # the tight accountant wins here
    assert eps["epsilon_valid"] == joint[best]
    # the configured (paper's) value is kept as `epsilon` and is below the joint moments value
    assert eps["epsilon"] == led.epsilon(DELTA, accountant="moments", convention="per_tensor")[0]
    assert eps["epsilon"] < joint["moments"]
    assert eps["refused"] == {}


def test_valid_epsilon_is_never_below_the_exact_gaussian_epsilon():
    # q = 1: k = 2 groups at σ = 4, 4 releases = one Gaussian mechanism with multiplier
    # s = (σ/√k)/√4 = √2 (joint convention, exact composition of Gaussians). Its exact δ(ε) is
    # Balle & Wang 2018, Thm 8: δ = Φ(1/(2s) − εs) − e^ε Φ(−1/(2s) − εs).
    c = _cfg(convention="joint")
    led = Ledger()
    led.record(Gaussian(4.0, groups=2), 4, "sgd")
    s = mpmath.sqrt(2)
    mpmath.mp.dps = 40
    delta = lambda e: (
        mpmath.ncdf(1 / (2 * s) - e * s) - mpmath.exp(e) * mpmath.ncdf(-1 / (2 * s) - e * s)
    )  # noqa: E731
    exact = float(mpmath.findroot(lambda e: delta(e) - DELTA, 3.0))
    eps = epsilons(led, c)
    assert eps["epsilon_valid"] >= exact  # never below what was spent
    assert eps["epsilon_valid"] == pytest.approx(
        exact, rel=1e-2
    )  # and tight (pessimistic PLD grid)
    assert Decimal(eps_up(eps["epsilon_valid"])) >= Decimal(exact)


def test_statement_leads_with_the_valid_guarantee_and_labels_the_papers_value(paper):
    c, led, eps = paper
    st = _statement(c, led, eps)
    text = st["statement"]
    assert text.startswith(
        f"({eps_up(eps['epsilon_valid'])}, 1e-05)-DP, pld accountant, joint convention, "
        "for the released model"
    )
    assert (
        f"paper's accounting (moments, per-tensor): ε = {eps_up(eps['epsilon'])} — under-states ε, "
        "reproduces the paper's numbers"
    ) in text
    assert text.index("pld accountant") < text.index("paper's accounting")
    assert st["epsilon_valid"] == eps["epsilon_valid"] and st["epsilon_valid_accountant"] == "pld"
    assert st["epsilon_valid_convention"] == "joint"
    assert st["epsilon"] == eps["epsilon"]  # the configured value (budget stop, collectors)
    assert st["epsilon_by_accountant"]["moments"]["per_tensor"] == eps["epsilon"]
    assert st["status"] == "complete" and st["stop_reason"] == "epochs_completed"
    line = final_line(st, 0.9457, "/tmp/run")
    assert (
        line.splitlines()[0] == "done (epochs_completed): 300 lots, 3 epochs, test accuracy 0.9457"
    )
    assert line.splitlines()[1] == text and "results: /tmp/run/metrics.csv" in line
    assert line.splitlines()[2].startswith("risk: membership attack TPR ≤ ")
    assert line.splitlines()[3].startswith(
        "not covered by ε (privacy.json not_covered): lot_loss, train_loss, "
        "train_accuracy (training-set loss and accuracy)"
    )


def test_configured_joint_accountant_is_labelled_looser_or_omitted():
    led = _ledger()
    c = _cfg(convention="joint")
    text = _statement(c, led, epsilons(led, c))["statement"]
    assert text.startswith("(") and "pld accountant, joint convention" in text
    assert "configured accounting (moments, joint)" in text and "valid but looser" in text
    c = _cfg(convention="joint", accountant="pld")
    text = _statement(c, led, epsilons(led, c))["statement"]
    assert "configured" not in text and "paper's" not in text


def test_printed_epsilon_is_rounded_up():
    assert eps_up(1.9999804475375396) == "2.000"
    assert eps_up(1.5826972901690053) == "1.583"
    assert eps_up(2.0) == "2.000" and eps_up(0.5) == "0.5000" and eps_up(12345.6) == "12350"
    assert eps_up(math.inf) == "∞" and eps_up(None) == "n/a" and eps_up(0.0) == "0"
    rng = random.Random(0)
    for _ in range(2000):
        x = 10 ** rng.uniform(-4, 4)
        assert Decimal(eps_up(x)) >= Decimal(x)
        assert Decimal(eps_up(x)) - Decimal(x) <= Decimal(x) * Decimal(
            "1e-3"
        )  # at most one unit in 4 digits


class _RefusesPld(Ledger):
    def epsilon(self, delta, accountant="moments", convention="joint", conversion="improved"):
        if accountant == "pld":
            raise ValueError("pld: ledger too long for the FFT grid (test)")
        return super().epsilon(delta, accountant, convention, conversion)


class _RefusesAll(Ledger):
    def epsilon(self, delta, accountant="moments", convention="joint", conversion="improved"):
        raise ValueError(f"{accountant}: refused (test)")


def test_a_refusing_accountant_is_skipped_and_recorded():
    c = _cfg(convention="per_tensor")
    led = _ledger(_RefusesPld)
    eps = epsilons(led, c)
    rdp = led.epsilon(DELTA, accountant="rdp", convention="joint")[0]
    assert eps["valid_accountant"] == "rdp" and eps["epsilon_valid"] == rdp
    assert eps["refused"]["pld"]["joint"] == "pld: ledger too long for the FFT grid (test)"
    assert eps["by"]["pld"]["joint"] == (None, None)
    st = _statement(c, led, eps)
    assert st["statement"].startswith(
        f"({eps_up(rdp)}, 1e-05)-DP, rdp accountant, joint convention"
    )
    assert st["epsilon_by_accountant"]["pld"] == {"per_tensor": None, "joint": None}
    assert "FFT grid" in st["epsilon_refused"]["pld"]["joint"]
    row = _row(c, eps)
    assert math.isnan(row["epsilon_pld_joint"]) and row["epsilon_valid"] == rdp


def test_every_accountant_refusing_makes_no_claim_and_does_not_crash(capsys):
    c = _cfg(convention="per_tensor")
    led = _ledger(_RefusesAll)
    eps = epsilons(led, c)
    assert (
        eps["epsilon_valid"] is None and eps["valid_accountant"] is None and eps["epsilon"] is None
    )
    st = _statement(c, led, eps)
    assert st["statement"].startswith("NO PRIVACY CLAIM: no valid (ε, δ) bound")
    assert "ε = n/a (refused: moments: refused (test))" in st["statement"]
    row = _row(c, eps)
    assert math.isnan(row["epsilon"]) and math.isnan(row["epsilon_valid"])
    progress_line(row, c)
    assert "no valid bound" in capsys.readouterr().out


def test_diverged_run_reports_the_spent_epsilon_but_releases_nothing(paper):
    c, led, eps = paper
    st = _statement(c, led, eps, status="diverged", stop_reason="diverged", steps=120)
    text = st["statement"]
    assert text.startswith(
        "DIVERGED after 120 lots (non-finite loss or parameter): the model is not released"
    )
    assert "for the released model" not in text
    assert (
        f"privacy spent on the training data so far: ({eps_up(eps['epsilon_valid'])}, 1e-05)-DP"
        in text
    )
    assert st["epsilon_valid"] == eps["epsilon_valid"]
    assert final_line(st, math.nan).startswith("DIVERGED (diverged): 120 lots")
    running = _statement(c, led, eps, status="running", stop_reason=None)["statement"]
    assert "for the model after 300 lots (run running)" in running


def test_status_vocabulary_and_bad_status(paper):
    c, led, eps = paper
    assert set(STATUSES) == {"running", "complete", "interrupted", "diverged"}
    with pytest.raises(ValueError, match="status must be one of"):
        _statement(c, led, eps, status="finished")
    with pytest.raises(ValueError, match="stop_reason must be"):
        _statement(c, led, eps, stop_reason="bored")


def test_metrics_columns_keep_their_order_and_progress_line_leads_with_valid(paper, capsys):
    c, led, eps = paper
    assert COLUMNS[:8] == [
        "epoch",
        "steps",
        "lr",
        "lot_loss",
        "train_loss",
        "train_accuracy",
        "test_accuracy",
        "epsilon",
    ]
    assert (
        COLUMNS[-2:] == ["wall_time_s", "epsilon_valid"] and len(COLUMNS) == len(set(COLUMNS)) == 31
    )
    row = _row(c, eps)
    assert set(row) == set(COLUMNS) and row["epsilon"] == eps["epsilon"]
    progress_line(row, c)
    out = capsys.readouterr().out
    assert f"ε≤{eps_up(eps['epsilon_valid'])} (pld, joint); paper's moments/per_tensor" in out


def test_nonprivate_statement():
    c = validate({"privacy": {"private": False}})
    eps = epsilons(None, c)
    assert math.isinf(eps["epsilon_valid"]) and eps["valid_accountant"] is None
    st = _statement(c, None, eps)
    # strict JSON: no Infinity; "not private" in words beside a null ε
    assert st["statement"].startswith("NOT PRIVATE") and st["private"] is False
    assert (
        st["epsilon"] is None and st["epsilon_valid"] is None and st["epsilon_by_accountant"] == {}
    )
    assert "not private" in st["not_covered"][0]["why"]
