"""python -m dpsgd.privacy --noise bandmf|blt: ε and σ of the charges training records, and the
strategy beside them."""

import json
import math

from dpsgd import privacy
from dpsgd.accountant import Ledger
from dpsgd.mechanism.cyclic import CyclicPoissonSampler, CyclicSampler
from dpsgd.mechanism.sampling import record_lots


def _json(capsys, *args):
    assert privacy.main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_epsilon_is_the_ledger_of_the_lots_training_charges(capsys):
    res = _json(
        capsys,
        "--N",
        "60000",
        "--L",
        "600",
        "--sigma",
        "5",
        "--steps",
        "1234",
        "--noise",
        "bandmf",
        "--bands",
        "4",
    )
    led = Ledger()
    record_lots(led, CyclicPoissonSampler(60000, 600, bands=4), 5.0, 1234)
    for acc, r in res["by_accountant"].items():
        assert r["epsilon"] == led.epsilon(1e-5, acc)[0]  # exact: the same ledger
    assert (res["charges"], res["cycle"]) == (math.ceil(1234 / 4), 4)
    assert len(res["strategy"]["coef"]) == 4 and 0 < res["expected_error_ratio"] < 1


def test_bands_1_calibrates_algorithm_1s_sigma(capsys):
    mf = _json(
        capsys,
        "--q",
        "0.01",
        "--target-epsilon",
        "2",
        "--steps",
        "3000",
        "--noise",
        "bandmf",
        "--bands",
        "1",
    )
    dp = _json(capsys, "--q", "0.01", "--target-epsilon", "2", "--steps", "3000")
    for acc in ("moments", "rdp", "pld"):
        assert mf["by_accountant"][acc]["sigma"] == dp[acc]["sigma"]  # exact: one search
    assert mf["expected_error_vs_dpsgd"] == 1.0  # exact: C = I


def test_blt_is_charged_once_per_epoch_without_amplification(capsys):
    res = _json(capsys, "--q", "0.01", "--target-epsilon", "2", "--epochs", "30", "--noise", "blt")
    assert (res["q_charge"], res["cycle"], res["lots"], res["charges"]) == (1.0, 100, 3000, 30)
    led = Ledger()
    best = res["accountant"]
    record_lots(led, CyclicSampler(60000, 600), res["by_accountant"][best]["sigma"], 3000)
    assert led.epsilon(1e-5, best)[0] <= 2.0
    assert res["strategy"]["kind"] == "blt" and res["strategy"]["min_sep"] == 100


def test_text_answer_leads_with_the_tightest(capsys):
    assert (
        privacy.main(
            ["--q", "0.01", "--sigma", "8", "--steps", "500", "--noise", "bandmf", "--bands", "2"]
        )
        == 0
    )
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ε = ") and "BandMF b = 2, cyclic Poisson over 2 parts" in out[0]
    assert out[-1].startswith("strategy: banded Toeplitz, b = 2")
