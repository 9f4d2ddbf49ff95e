"""Calibration: σ for a target ε never overshoots and lands within 1 %; steps / epochs in a
budget."""

import pytest

from dpsgd.accountant import calibrate

DELTA = 1e-5


@pytest.mark.parametrize(
    "accountant", ["moments", "rdp", "pld", "strong_composition", "strong_composition_valid"]
)
def test_sigma_round_trip(accountant):
    target = 2.0
    sigma = calibrate.sigma_for_epsilon(target, DELTA, q=0.01, steps=2_000, accountant=accountant)
    eps = calibrate.epsilon(0.01, sigma, 2_000, DELTA, accountant)
    assert eps <= target
    assert eps >= 0.99 * target


def test_sigma_round_trip_groups_and_ordering():
    s_joint = calibrate.sigma_for_epsilon(
        1.0, DELTA, 0.01, 1000, "rdp", groups=3, convention="joint"
    )
    s_pt = calibrate.sigma_for_epsilon(
        1.0, DELTA, 0.01, 1000, "rdp", groups=3, convention="per_tensor"
    )
    assert s_pt < s_joint
    s_pld = calibrate.sigma_for_epsilon(1.0, DELTA, 0.01, 1000, "pld")
    s_mom = calibrate.sigma_for_epsilon(1.0, DELTA, 0.01, 1000, "moments")
    assert s_pld < s_mom


def test_max_steps_and_epochs():
    n = calibrate.max_steps(2.0, DELTA, 0.01, 4.0, "moments")
    assert (
        calibrate.epsilon(0.01, 4.0, n, DELTA, "moments")
        <= 2.0
        < calibrate.epsilon(0.01, 4.0, n + 1, DELTA, "moments")
    )
    assert calibrate.max_epochs(2.0, DELTA, 0.01, 4.0, "moments") == int(n * 0.01)


def test_calibration_needs_steps():
    with pytest.raises(ValueError, match="steps"):
        calibrate.sigma_for_epsilon(1.0, DELTA, 0.01, 0)


def test_moments_floor_is_named_and_others_still_answer():
    # log(1/δ)/32 = 0.5756 > 0.491 at δ = 1e-8: no σ can reach it under the moments accountant
    with pytest.raises(ValueError, match=r"moments.*floor.*0\.5756"):
        calibrate.sigma_for_epsilon(0.491, 1e-8, 0.00187, 23915, "moments")
    s_rdp = calibrate.sigma_for_epsilon(0.491, 1e-8, 0.00187, 23915, "rdp")
    s_pld = calibrate.sigma_for_epsilon(0.491, 1e-8, 0.00187, 23915, "pld")
    # σ printed to 2 decimals; calibration stops within rtol 0.005 of the target ε
    assert s_rdp == pytest.approx(3.18, abs=0.01) and s_pld == pytest.approx(3.02, abs=0.01)


def test_search_stays_in_the_serviceable_sigma_range():
    from dpsgd.accountant.limits import SIGMA_MIN

    with pytest.raises(ValueError, match=r"rdp: .*SIGMA_MIN"):
        calibrate.sigma_for_epsilon(10_000.0, DELTA, 1.0, 1, "rdp")
    with pytest.raises(ValueError, match=r"strong_composition: .*SIGMA_MAX"):
        calibrate.sigma_for_epsilon(1e-9, DELTA, 1.0, 1, "strong_composition")
    assert calibrate.sigma_for_epsilon(600.0, DELTA, 1.0, 1, "rdp") >= SIGMA_MIN
