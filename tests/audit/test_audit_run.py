"""The one-run audit of a training configuration (dpsgd/audit/onerun/run.py): canaries through the
real run, broken variants caught, the correct mechanism consistent, labels, reproducibility,
refusals."""

import csv
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from dpsgd.audit.onerun.canaries import CanaryDraw, GradientCanaries, add_canaries
from dpsgd.audit.onerun.placement import place
from dpsgd.audit.onerun.instrument import AuditOptions
from dpsgd.audit.onerun.run import ENV, audit_train, split_args
from dpsgd.config.schema import validate
from dpsgd.core.errors import ConfigError
from dpsgd.mechanism.clipping import PerExampleClipper
from dpsgd.run.checkpoint import load_checkpoint
from dpsgd.launch.main import compose

REPO = Path(__file__).resolve().parents[2]
# 300 real MNIST images and 2000 gradient canaries (N = 2300), L = 300 (q ≈ 0.13), 6 epochs = 48
# lots, 200 hidden units on 10 PCA dims: each of the k = 2 clipping groups has 2000 coordinates, one
# per canary. σ = 3 claims ε ≈ 2.0: small enough for the one-run bound (m = 2000) to exceed it when
# the noise is cut 4×.
TINY = [
    "dataset.subset=300",
    "privacy.lot_size=300",
    "model.hidden=[200]",
    "model.pca_dims=10",
    "training.epochs=6",
    "device=cpu",
    "privacy.sigma=3",
    "privacy.sigma_p=20",
    "training.eval_batch_size=1000",
]


def _audit(tmp_path, monkeypatch, name, overrides=(), **options):
    o = AuditOptions(
        **{"gradient_canaries": 2000, "input_canaries": 0, "ranks": 16, **options}
    ).validate()
    monkeypatch.setenv(ENV, json.dumps(asdict(o)))
    run_dir = tmp_path / name
    audit_train(validate(compose(TINY + list(overrides))), run_dir, TINY + list(overrides))
    return json.loads((run_dir / "audit.json").read_text()), run_dir


@pytest.mark.parametrize("variant", ["no_clip", "noise_div10", "noise_per_rank"])
def test_broken_variants_are_flagged(tmp_path, monkeypatch, variant):
    a, _ = _audit(tmp_path, monkeypatch, variant, variant=variant)
    assert a["verdict"] == "violation" and a["eps_lower_bound"] > a["eps_claimed"]
    # the family test of the lots' claim (family.py) flags them too, with its ε_lb above the lots'
    # claim
    assert a["verdict_family"] == "violation" and a["family"]["claim_rejected"]
    assert a["family"]["eps_lower_bound"] > a["family"]["eps_claimed_lots"]


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("privacy.clipping=global",),
        ("training.momentum=0.5", "training.ema_decay=0.9"),
        ("privacy.sampling=shuffle",),
    ],
)
def test_correct_mechanism_is_consistent(tmp_path, monkeypatch, overrides):
    a, _ = _audit(tmp_path, monkeypatch, "run", overrides, input_canaries=100)
    assert a["verdict"] == "consistent" and a["eps_lower_bound"] <= a["eps_claimed"]
    assert [g["game"].split(":")[0] for g in a["games"]] == ["white-box", "black-box"]
    assert all(
        g["beta"] == pytest.approx(0.025) for g in a["games"]
    )  # β/2 each: the larger bound at 1 − β
    if "privacy.sampling=shuffle" in overrides:
        assert "family" not in a  # the family is the Poisson-subsampled Gaussian
    else:
        assert (
            a["verdict_family"] == "consistent"
            and a["family"]["eps_lower_bound"] <= a["family"]["eps_claimed_lots"]
        )
        osb = a["family"]["order_stats"]  # labelled, and never the verdict
        assert "independent canaries" in osb["assumes"] and "heuristic" in osb["label"]


def test_audit_run_is_labelled_reproducible_and_not_resumed(tmp_path, monkeypatch):
    a, run_dir = _audit(tmp_path, monkeypatch, "a", input_canaries=50)
    b, _ = _audit(tmp_path, monkeypatch, "b", input_canaries=50)
    strip = lambda d: {k: v for k, v in d.items() if k != "seconds"}  # noqa: E731
    assert strip(a) == strip(b)  # a seeded audit reproduces its audit.json
    assert (run_dir / "audit_scores.csv").read_text() == (
        tmp_path / "b" / "audit_scores.csv"
    ).read_text()
    privacy = json.loads((run_dir / "privacy.json").read_text())
    assert (
        privacy["statement"].startswith("AUDIT RUN")
        and privacy["audit_run"]["options"]["gradient_canaries"] == 2000
    )
    with open(run_dir / "metrics.csv", newline="") as f:
        assert all(r["audit"].startswith("one-run audit") for r in csv.DictReader(f))
    assert load_checkpoint(run_dir)["audit"]["summary"] == privacy["audit_run"]["summary"]
    assert (run_dir / "config.resolved.yaml").read_text().startswith("# AUDIT RUN")
    from experiments.runs import find_runs

    (run_dir / ".hydra").mkdir()  # as the command line leaves it
    assert find_runs([tmp_path]) == []  # never collected as a training result
    r = subprocess.run(
        [sys.executable, "-m", "dpsgd.train", f"resume={run_dir}"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "is an audit run" in r.stderr


def test_the_claim_does_not_depend_on_the_bits(tmp_path, monkeypatch):
    """Every canary has a row whatever its bit (an excluded one has a zero gradient): N, q and ε are
    the same."""
    a, _ = _audit(tmp_path, monkeypatch, "s0", seed=0)
    b, _ = _audit(tmp_path, monkeypatch, "s1", seed=1)
    assert a["games"][0]["included"] != b["games"][0]["included"]
    assert (a["run"]["N"], a["run"]["q"], a["eps_claimed"]) == (
        b["run"]["N"],
        b["run"]["q"],
        b["eps_claimed"],
    )  # exact: same ledger


def test_gradient_canaries_enter_the_engine_clipped_to_C():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8, bias=False), torch.nn.ReLU(), torch.nn.Linear(8, 3, bias=False)
    )
    inner = PerExampleClipper(model, clip_norm=1.5, clipping="per_layer")
    placed = place(inner, 4, 0, "dirac")
    assert placed["groups_used"] == 2
    included = torch.tensor([True, False, True, True])
    wrapped = GradientCanaries(inner, placed["coords"], included, a=15.0)
    x, y = torch.randn(5, 6), torch.tensor([0, 1, 2, 0, 1])
    real = inner.clipped_sum(x, y).grads
    xs = torch.cat([x, torch.zeros(3, 6)])
    ys = torch.cat(
        [y, torch.tensor([-1, -2, -4])]
    )  # canaries 0 (in), 1 (out: zero gradient), 3 (in)
    got = wrapped.clipped_sum(xs, ys).grads
    for n, g in got.items():
        diff = (g - real[n]).reshape(-1)
        want = torch.zeros_like(diff)
        for i in (0, 3):
            want[placed["coords"][n][i]] = 1.5  # a = 15 clipped to C = 1.5 in its group
        assert torch.allclose(diff, want, atol=1e-6)  # float32 sums of ≤ 6 terms of size ≤ 1.5


def test_canary_rows_keep_N_fixed():
    X, y = torch.randn(50, 4), torch.randint(0, 10, (50,))
    draw = CanaryDraw.draw(7, 5, seed=3)
    X2, y2, Xc, yc = add_canaries(X, y, draw, 10, seed=3)
    assert len(X2) == 50 - 5 + int(draw.input_in.sum()) + 7 + int((~draw.input_in).sum()) == 57
    assert bool((yc != y[-5:]).all())  # every input canary has a wrong label
    assert int((y2 < 0).sum()) == 7 + int((~draw.input_in).sum())


@pytest.mark.parametrize(
    "arg, key",
    [
        ("audit.variant=oops", "audit.variant"),
        ("audit.gradient_canaries=-1", "audit.gradient_canaries"),
        ("audit.beta=0.9", "audit.beta"),
        ("audit.nope=1", "audit.nope"),
    ],
)
def test_bad_audit_options_are_refused_in_one_line(arg, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        split_args(["experiment=mnist_medium", arg])


@pytest.mark.parametrize("given_dir", [False, True])
def test_input_canaries_beyond_the_data_are_refused_before_the_run_folder(
    given_dir, tmp_path, monkeypatch, capsys
):
    """audit.input_canaries >= the run's N (they are taken from its rows): one line naming the
    option, exit 2, and no run folder (the default outputs/audit/... or hydra.run.dir) is made."""
    from dpsgd.audit.onerun.run import check_canaries_fit, main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(ENV, raising=False)
    args = (
        TINY
        + ["audit.input_canaries=300"]
        + ([f"hydra.run.dir={tmp_path / 'x'}"] if given_dir else [])
    )
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == (
        "error: audit.input_canaries=300: needs fewer than the 300 training "
        "examples (the input canaries are taken from them)\n"
    ), err
    assert list(tmp_path.iterdir()) == []
    check_canaries_fit(
        AuditOptions(input_canaries=299).validate(), TINY
    )  # 299 of 300 rows: accepted
    with pytest.raises(ConfigError, match=r"^audit.input_canaries=300: needs fewer than the 300 "):
        add_canaries(
            torch.zeros(300, 4),
            torch.zeros(300, dtype=torch.long),
            CanaryDraw.draw(0, 300, 0),
            10,
            0,
        )


def test_cli_refuses_before_any_work(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpsgd.audit",
            "run",
            "audit.score=max",
            f"hydra.run.dir={tmp_path / 'x'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert (
        r.returncode == 2 and "audit.score" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    )
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_torchrun_audit_equals_one_process(tmp_path, monkeypatch):
    """Two ranks: the canaries land in either rank's share, the aggregator sums them and adds the
    noise once; the audit sees the same releases as in one process."""
    import os
    import shutil

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which(
        "torchrun"
    )
    if torchrun is None:
        pytest.skip("torchrun not installed")
    args = TINY + ["training.epochs=2", "audit.gradient_canaries=2000", "audit.input_canaries=50"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    two = subprocess.run(
        [
            torchrun,
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "dpsgd.audit",
            "run",
            *args,
            f"hydra.run.dir={tmp_path / 'two'}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert two.returncode == 0, two.stderr[-2000:]
    one = subprocess.run(
        [sys.executable, "-m", "dpsgd.audit", "run", *args, f"hydra.run.dir={tmp_path / 'one'}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    a, b = (json.loads((tmp_path / r / "audit.json").read_text()) for r in ("one", "two"))
    assert a["eps_claimed"] == b["eps_claimed"]  # exact: the same ledger
    rows = [list(csv.DictReader(open(tmp_path / r / "audit_scores.csv"))) for r in ("one", "two")]
    assert [r["included"] for r in rows[0]] == [r["included"] for r in rows[1]]
    white = [[float(r["score"]) for r in rs if r["game"] == "white-box"] for rs in rows]
    # float32 parameters: the two ranks sum each lot in another order, ~n·eps32 of the update per
    # step, a few 1e-6 of a z unit per step over 16 steps; scores are sums of 16 per-step terms
    assert max(abs(x - y) for x, y in zip(*white)) < 1e-3
