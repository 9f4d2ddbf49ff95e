"""experiments/correlated_noise.py: the plan gives BandMF and BLT the DP-SGD run's lots at the σ
that spends the same ε, and the collected rows make the README table and the figure."""

import pandas as pd
import pytest

from experiments import correlated_figure, correlated_noise as cn

TINY = ("dataset.subset=6000", "privacy.lot_size=60", "training.max_steps=40")


@pytest.mark.slow
def test_plan_spends_the_same_epsilon_on_the_same_lots():
    from dpsgd.accountant import Ledger
    from dpsgd.mechanism.pca import charge_pca
    from dpsgd.mechanism.cyclic import make_run_sampler
    from dpsgd.mechanism.sampling import record_lots

    sp = cn.setting_plan("mnist_paper_tight", 0.5, TINY)
    assert sp["lots"] == 40 and sp["lots_per_epoch"] % sp["bandmf"]["bands"] == 0
    for m, noise in (("bandmf", "bandmf"), ("blt", "blt")):
        o = sp[m]["overrides"]
        assert f"privacy.noise={noise}" in o and "training.max_steps=40" in o
        led = Ledger()
        charge_pca(led, 16.0, 1.0)
        bands = sp[m].get("bands")
        record_lots(
            led,
            make_run_sampler(noise, "poisson", 6000, 60, None, None, bands),
            sp[m]["sigma"],
            40,
            0,
            2,
        )
        assert 0.5 * (1 - 0.002) <= led.epsilon(1e-5, "pld", "joint")[0] <= 0.5


def test_table_and_figure_from_rows(tmp_path):
    rows = []
    for m, bands, acc in (("dpsgd", None, 0.95), ("bandmf", 5, 0.951), ("blt", None, 0.94)):
        for seed in (0, 1):
            rows.append(
                dict.fromkeys(cn.COLUMNS)
                | {
                    "setting": "mnist_paper_tight",
                    "epsilon_target": 2.0,
                    "method": m,
                    "seed": seed,
                    "bands": bands,
                    "buffers": 2 if m == "blt" else (4 if m == "bandmf" else 0),
                    "sigma": 4.0,
                    "noise_std_per_step": 16.0,
                    "predicted_error_vs_dpsgd": 1.0,
                    "epsilon_spent": 1.99,
                    "lots": 17204,
                    "test_accuracy": acc + seed / 1000,
                    "cpu_time_s": 60.0,
                    "max_rss_mb": 1500.0,
                    "noise_state_mb": 0.5,
                    "wall_time_s": 90.0,
                }
            )
    cn.write_csv(rows, tmp_path / "correlated_noise.csv")
    df = pd.read_csv(tmp_path / "correlated_noise.csv")
    table = correlated_figure.table_rows(df)
    assert sum(line.startswith("| `mnist_paper_tight` | 2 |") for line in table) == 3
    assert any("BandMF, b = 5 | 95.15 ± 0.07 % (2)" in line for line in table)
    paths = correlated_figure.draw(df, tmp_path / "figures")
    assert all(p.is_file() for p in paths)
