"""Figure 6 (CIFAR-10, §5.3): collected from real run folders, drawn and tabulated from
results/figure6.csv only; without that CSV no figure is drawn and the READMEs say the numbers were
not measured.

The figure and the README rows are rendered from tests/fixtures/figure6_fixture.csv, a synthetic
FIXTURE (never a result; tests/fixtures/README.md)."""

import json
import math
import os
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

from dpsgd.config.schema import validate
from dpsgd.launch.main import compose
from dpsgd.run.report import COLUMNS as METRICS_COLUMNS
from dpsgd.train import train
from experiments import claims, collect, figure6, figures, readme, style
from fake_runs import fake_run

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "results"
FIXTURE = REPO / "tests" / "fixtures" / "figure6_fixture.csv"


def _fixture() -> pd.DataFrame:
    return pd.read_csv(FIXTURE)


def _png_width(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[16:20], "big")


# ------------------------------------------------------------------------------- from the fixture
def test_figure6_and_the_readme_section_render_from_the_fixture(tmp_path):
    """`make figures` on a results folder holding the fixture as figure6.csv: the figure, and the
    README's CIFAR section, file list and image. (Byte-determinism is `_save`'s, shared with every
    figure and checked in tests/e2e/test_experiments.py.)"""
    df = _fixture()
    assert set(df.columns) == set(figure6.COLUMNS)
    assert set(df["hardware"]) == {
        "FIXTURE (synthetic, not a measurement)"
    }  # labelled, never a result
    res = tmp_path / "results"
    res.mkdir()
    shutil.copy(FIXTURE, res / "figure6.csv")
    assert figures.main(["--results", str(res)]) == 0
    png, pdf = res / "figures" / "figure6.png", res / "figures" / "figure6.pdf"
    assert png.stat().st_size > 1000 and pdf.stat().st_size > 1000
    # printed at a paper's text width, as Figures 3 and 4
    assert _png_width(png) <= (style.COLUMN_WIDTH_IN + 0.2) * style.COLUMN_DPI
    out = (res / "README.md").read_text(encoding="utf-8")
    assert "## §5.3 / Figure 6 — CIFAR-10" in out and "- `figure6.csv`" in out
    assert "![figure6](figures/figure6.png)" in out and readme.CIFAR_NOT_MEASURED not in out
    assert "\n".join(readme.cifar_rows(df)) in out


def test_readme_cifar_rows_come_from_figure6_csv():
    df = _fixture()
    text = "\n".join(readme.cifar_rows(df))
    assert readme.CIFAR_NOT_MEASURED not in text
    for preset, p in claims.CIFAR10_PRESETS.items():
        r = df[df["preset"] == preset].sort_values("steps").iloc[-1]
        line = next(l for l in text.splitlines() if l.startswith(f"| {preset} |"))
        assert f"{100 * p['accuracy']:g} %" in line  # the paper's value
        assert f"| {100 * r['test_accuracy']:.2f} % |" in line  # ours
        assert f"| {r['steps'] * r['q']:.1f} | {int(r['steps'])} | {r['stop_reason']} |" in line
        assert f"`python -m dpsgd.train experiment={preset}`" in line
        if math.isfinite(p["epsilon"]):
            assert f"ε = {p['epsilon']:g}, L = {p['lot_size']}" in line
            assert f"| {r['epsilon']:.2f} | {r['epsilon_pld_joint']:.2f} |" in line
            assert r["epsilon"] <= p["epsilon"]  # the budget stop: never above
    # a preset not run yet says so
    text = "\n".join(readme.cifar_rows(df[df["preset"] != "cifar10_eps8"]))
    assert "| cifar10_eps8 |" in text and "not run yet" in text


# ------------------------------------------------------------------------------- without the CSV
def test_without_figure6_csv_nothing_is_drawn_and_the_readmes_say_not_measured(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    figures.main(["--results", str(res)])  # nothing to draw at all: rc 1, the README still written
    out = (res / "README.md").read_text(encoding="utf-8")
    assert readme.CIFAR_NOT_MEASURED in out and "`make cifar10-all`" in out
    assert "figure6" not in out
    assert not list(res.rglob("figure6*"))
    # the committed READMEs agree with what results/ holds
    committed = (RESULTS / "README.md").read_text(encoding="utf-8")
    top = (REPO / "README.md").read_text(encoding="utf-8")
    if (RESULTS / "figure6.csv").exists():
        assert readme.CIFAR_NOT_MEASURED not in committed
    else:
        assert readme.CIFAR_NOT_MEASURED in committed
        assert not list((RESULTS / "figures").glob("figure6*"))
        assert (
            "CIFAR-10 numbers" in top and "not been measured" in top and "`make cifar10-all`" in top
        )


# ------------------------------------------------------------------------------- the collector
@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """metrics.csv and privacy.json exactly as training writes them (a tiny real MNIST run)."""
    run = tmp_path_factory.mktemp("train") / "run"
    c = validate(
        compose(
            [
                "dataset.subset=1000",
                "privacy.lot_size=100",
                "model.hidden=[50]",
                "training.max_steps=3",
                "device=cpu",
            ]
        )
    )
    train(c, run)
    return run


def _fake_cifar_run(root: Path, src: Path, preset: str, name: str, overrides=(), acc=None) -> Path:
    """A run folder as `python -m dpsgd.train experiment=<preset>` leaves it (.hydra included)."""
    return fake_run(root, src, preset, name, 0, overrides, acc)


def test_collect_turns_cifar_run_folders_into_figure6_csv(real_run, tmp_path):
    metrics = pd.read_csv(real_run / "metrics.csv")
    privacy = json.loads((real_run / "privacy.json").read_text())
    assert set(METRICS_COLUMNS) <= set(metrics.columns) and privacy["status"] == "complete"
    roots = tmp_path / "outputs"
    _fake_cifar_run(roots, real_run, "cifar10_eps2", "a_old", acc=0.11)
    newest = _fake_cifar_run(roots, real_run, "cifar10_eps2", "b_new", acc=0.66)
    _fake_cifar_run(roots, real_run, "cifar10_eps8", "c", acc=0.72)
    _fake_cifar_run(
        roots, real_run, "cifar10_eps4", "d_tuned", overrides=["privacy.sigma=3"]
    )  # not a preset run
    for i, name in enumerate(("a_old", "b_new", "c", "d_tuned")):  # the order they finished in
        os.utime(roots / name / "privacy.json", (1_700_000_000 + i,) * 2)
    res = tmp_path / "results"
    written = collect.collect([roots], res, hardware="test-hw")
    f6 = pd.read_csv(res / "figure6.csv")
    assert written == {"figure6.csv": len(f6)}  # no MNIST run: nothing else written
    assert list(f6.columns) == figure6.COLUMNS
    assert list(dict.fromkeys(f6["preset"])) == [
        "cifar10_eps2",
        "cifar10_eps8",
    ]  # the paper's order
    for preset, acc in (("cifar10_eps2", 0.66), ("cifar10_eps8", 0.72)):
        d = f6[f6["preset"] == preset]
        assert len(d) == len(metrics)
        # a decimal value through a CSV round trip: pytest's default rel 1e-6
        assert d["test_accuracy"].iloc[-1] == pytest.approx(acc)
        for col in ("epoch", "steps", "epsilon", "epsilon_pld_joint", "q", "L", "sigma", "groups"):
            assert list(d[col]) == pytest.approx(list(metrics[col])), col
        assert set(d["stop_reason"]) == {privacy["stop_reason"]}
        assert set(d["hardware"]) == {privacy["runtime"]["hardware"]}
        assert (res / "runs" / preset / "metrics.csv").exists() and (
            res / "runs" / preset / "privacy.json"
        ).exists()
    assert set(f6[f6["preset"] == "cifar10_eps2"]["run"]) == {
        str(newest)
    }  # the newest run of a preset wins
    # pinning an older run of a preset
    collect.collect([roots], res, hardware="test-hw", pinned={"cifar10_eps2": roots / "a_old"})
    f6 = pd.read_csv(res / "figure6.csv")
    # a decimal value through a CSV round trip: pytest's default rel 1e-6
    assert f6[f6["preset"] == "cifar10_eps2"]["test_accuracy"].iloc[-1] == pytest.approx(0.11)


def test_claims_match_the_cifar_presets_when_present():
    """The paper's settings the figure, README and benchmark use are the presets' (once they
    exist)."""
    for preset, p in claims.CIFAR10_PRESETS.items():
        if not (REPO / "conf" / "experiment" / f"{preset}.yaml").exists():
            continue
        c = compose([f"experiment={preset}"])
        assert c.name == preset
        if math.isfinite(p["epsilon"]):
            pr = c.privacy
            assert (pr.sigma, pr.lot_size, pr.clip_norm, pr.target_epsilon, pr.delta) == (
                p["sigma"],
                p["lot_size"],
                p["clip_norm"],
                p["epsilon"],
                claims.DELTA,
            )
            assert pr.convention == "per_tensor" and pr.clipping == "per_layer"
