"""The step benchmark's protocol runs end to end (tiny settings; timings are never asserted)."""

import csv
import sys

import pytest

from bench import bench_step


@pytest.mark.slow  # ~14 s: 3 benchmark processes; the one-line refusals below stay fast
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memory children read /proc")
def test_bench_step_processes_aggregate(tmp_path):
    out = tmp_path / "bench.csv"
    bench_step.main(
        [
            "--processes",
            "2",
            "--models",
            "mnist_pca60_mlp1000",
            "--methods",
            "nonprivate,dpsgd_ghost",
            "--reps",
            "2",
            "--warmup",
            "0",
            "--block-s",
            "0.01",
            "--lot",
            "64",
            "--out",
            str(out),
        ]
    )
    rows = list(csv.DictReader(out.open()))
    assert [r["method"] for r in rows] == ["nonprivate", "dpsgd_ghost"]
    assert all(r.keys() == set(bench_step.COLUMNS) for r in rows)
    for r in rows:
        assert r["processes"] == "2" and int(r["steps_per_rep"]) >= 1
        assert float(r["ratio_min"]) <= float(r["ratio_to_nonprivate"]) <= float(r["ratio_max"])
        assert float(r["examples_per_s"]) > 0 and float(r["peak_mem_mb"]) >= 0
    assert float(rows[0]["ratio_to_nonprivate"]) == 1.0


@pytest.mark.parametrize(
    "args, says",
    [
        (["--models", "nope"], "--models: unknown ['nope']"),
        (["--methods", "dpsgd_magic"], "--methods: unknown ['dpsgd_magic']"),
        (["--reps", "0"], "--reps and --processes must be >= 1"),
        (["--lots", "-5"], "--lots=-5: a comma list of lot sizes"),
        (["--lot", "0"], "--lot=0: a lot of at least 1"),
    ],
)
def test_bench_step_bad_options_are_one_line_before_any_child(
    args, says, tmp_path, monkeypatch, capsys
):
    """Checked in the parent, before a child process starts: one line, exit 2, no traceback."""
    monkeypatch.setattr(
        bench_step.subprocess, "run", lambda *a, **k: pytest.fail("a child was started")
    )
    with pytest.raises(SystemExit) as e:
        bench_step.main(args + ["--out", str(tmp_path / "b.csv")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("python -m bench.bench_step: error: ") and says in err, err
    assert list(tmp_path.iterdir()) == []


def test_bench_step_a_failed_child_ends_with_its_exit_code(tmp_path, monkeypatch, capsys):
    """A child that fails (it printed its own one line) ends the parent with the child's exit code
    and nothing more: no traceback of the parent after the child's line."""
    import subprocess

    monkeypatch.setattr(
        bench_step.subprocess, "run", lambda cmd, **k: subprocess.CompletedProcess(cmd, 3)
    )
    with pytest.raises(SystemExit) as e:
        bench_step.main(
            [
                "--processes",
                "2",
                "--models",
                "mnist_pca60_mlp1000",
                "--out",
                str(tmp_path / "b.csv"),
            ]
        )
    assert e.value.code == 3 and "Traceback" not in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_bench_gemm_routes_agree_and_csv(tmp_path):
    from bench import bench_gemm

    for p, d in [(1000, 60), (10, 1000)]:
        got = {k: f() for k, f in bench_gemm.routes(p, d, 16).items()}
        assert got["direct"].shape == got["transposed"].shape == (p, d)
        assert got["transposed"].is_contiguous()
        assert (got["direct"] - got["transposed"]).abs().max() <= 1e-4 * got["direct"].abs().max()
    out = tmp_path / "gemm.csv"
    bench_gemm.main(["--batch", "8", "--rounds", "1", "--calls", "1", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == len(bench_gemm.SHAPES) and all(
        r.keys() == set(bench_gemm.COLUMNS) for r in rows
    )
    assert {r["engine_uses"] for r in rows} == {"direct", "transposed"}


def test_bench_distributed_protocol(tmp_path):
    """1 plain process and 2 gloo ranks (forked) step real lots; the CSV has its columns."""
    from bench import bench_distributed

    out = tmp_path / "dist.csv"
    bench_distributed.main(
        [
            "--lots",
            "32",
            "--processes",
            "2",
            "--steps",
            "1",
            "--reps",
            "1",
            "--subset",
            "1000",
            "--out",
            str(out),
        ]
    )
    rows = list(csv.DictReader(out.open()))
    assert [(r["mode"], r["processes"]) for r in rows] == [
        ("plain", "1"),
        ("torch.distributed", "2"),
    ]
    assert all(r.keys() == set(bench_distributed.COLUMNS) for r in rows)
    assert int(rows[1]["allreduce_bytes"]) == 4 * (60 * 1000 + 1000 * 10 + 2)
    assert float(rows[1]["examples_per_s"]) > 0 and 0 <= float(rows[1]["allreduce_share"])


def test_bench_cifar_epoch_protocol_and_preset_budgets(tmp_path):
    """One epoch per method on 100 images (lots scaled by 100/50 000), the eval pass, and each
    preset's lots within its target ε from the accountant (timings are never asserted)."""
    from bench import bench_cifar_epoch as b
    from dpsgd.accountant import Ledger
    from dpsgd.accountant.events import Poisson
    from experiments.claims import DELTA

    out = tmp_path / "cifar_epoch.csv"
    b.main(["--n", "100", "--n-test", "10", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert all(r.keys() == set(b.COLUMNS) for r in rows)
    epochs = [r for r in rows if r["kind"] == "epoch"]
    settings = b.preset_settings()
    dp_lots = {p["lot_size"] for p in settings.values() if p["sigma"] > 0}
    assert {(r["name"], int(r["lot"])) for r in epochs if r["name"] != "nonprivate"} == {
        ("dpsgd_ghost_frozen", round(L * 100 / b.N)) for L in dp_lots
    }
    for r in epochs:
        assert int(r["examples"]) > 0 and float(r["cpu_s"]) > 0 and float(r["examples_per_s"]) > 0
        assert r["groups"] == (
            "0" if r["name"] == "nonprivate" else "3"
        )  # frozen convs: 3 dense layers
    assert [r["kind"] for r in rows].count("eval") == 1
    presets = {r["name"]: r for r in rows if r["kind"] == "preset"}
    assert set(presets) == set(settings)
    for name, p in settings.items():
        r = presets[name]
        q = p["lot_size"] / b.N
        if (
            p["sigma"] > 0
        ):  # the accountant's budget at k = 3 groups; its PLD ε never above the target
            lots = Ledger().steps_within(
                p["epsilon"], DELTA, Poisson(q, p["sigma"], 3), p["accountant"], p["convention"]
            )
            # the CSV keeps epochs to 2 decimals (half a unit)
            assert int(r["preset_lots"]) == lots and float(r["epochs"]) == pytest.approx(
                lots * q, abs=0.005
            )
            assert 0 < float(r["epsilon_pld_joint"]) <= p["epsilon"]
        else:
            assert float(r["epochs"]) == p["epochs"]
        per_epoch = float(r["epoch_s"]) + float(r["eval_s"]) / int(r["eval_every"])
        # the CSV keeps hours, epochs and timings to 2 decimals (half a unit each, through the
        # product)
        assert float(r["projected_h"]) == pytest.approx(
            float(r["epochs"]) * per_epoch / 3600, abs=0.006
        )


@pytest.mark.slow
def test_bench_run_times_every_phase_of_a_whole_run(tmp_path):
    """python -m bench.bench_run: a DP and a non-private child, every phase timed, the parts within
    the total."""
    from bench import bench_run

    out = tmp_path / "run.csv"
    bench_run.main(["--epochs", "1", "--repeats", "1", "--out", str(out)])
    rows = list(csv.DictReader(open(out)))
    assert {r["phase"] for r in rows} == set(bench_run.PHASES) and {r["private"] for r in rows} == {
        "True",
        "False",
    }
    for private in ("True", "False"):
        t = {r["phase"]: float(r["seconds"]) for r in rows if r["private"] == private}
        assert 0 < t["steps"] <= t["lots"] < t["total"] and t["startup"] < t["total"]
        assert (
            int(next(r["lots"] for r in rows if r["private"] == private)) == 100
        )  # one epoch of mnist_medium


def test_bench_run_refuses_bad_options_in_one_line(capsys):
    from bench import bench_run

    with pytest.raises(SystemExit) as e:
        bench_run.main(["--repeats", "0"])
    assert e.value.code == 2 and "--repeats=0" in capsys.readouterr().err


def test_bench_proof_runs_end_to_end(tmp_path):
    """The proofs' benchmark protocol (bench/bench_proof.py), tiny: two models, one repetition."""
    from bench import bench_proof

    out = tmp_path / "proof.csv"
    bench_proof.main(
        ["--models", "seq_first_linear,tanh_cnn_groupnorm", "--reps", "1", "--out", str(out)]
    )
    rows = list(csv.DictReader(out.open()))
    assert [r["model"] for r in rows] == ["seq_first_linear", "tanh_cnn_groupnorm"]
    assert all(r.keys() == set(bench_proof.COLUMNS) for r in rows)
    assert [r["engine"] for r in rows] == ["ghost+vmap", "ghost"]  # B = T proved wrong: vmap


def _bench_models(tmp_path, models, methods):
    from bench import bench_models

    out = tmp_path / "models.csv"
    assert bench_models.main(["--quick", "--models", models, "--methods", methods,
                              "--out", str(out)]) == 0  # fmt: skip
    rows = list(csv.DictReader(out.open()))
    assert all(r.keys() == set(bench_models.COLUMNS) for r in rows)
    for r in rows:
        assert int(r["reps"]) == 2 and int(r["steps_per_rep"]) >= 1 and float(r["step_ms"]) > 0
        assert float(r["ratio_min"]) <= float(r["ratio"]) <= float(r["ratio_max"])
    assert {float(r["ratio"]) for r in rows if r["method"] == "plain"} == {1.0}
    return rows


def test_bench_models_protocol_on_the_paper_mlp(tmp_path):
    """plain, PrivateTrainer(private=False) and DP (noise ahead and in the step), interleaved, every
    ratio against the plain step of the same repetition (timings are never asserted)."""
    rows = _bench_models(tmp_path, "paper_mlp", "plain,nonprivate,dpsgd,dpsgd_1core")
    assert [r["method"] for r in rows] == ["plain", "nonprivate", "dpsgd", "dpsgd_1core"]


@pytest.mark.slow  # ~40 s: resnet18's first call proves it on a float64 twin
def test_bench_models_protocol_on_every_model(tmp_path):
    rows = _bench_models(tmp_path, "resnet18_gn,text_transformer", "plain,nonprivate,dpsgd")
    assert [(r["model"], r["method"]) for r in rows] == [
        (m, k)
        for m in ("resnet18_gn", "text_transformer")
        for k in ("plain", "nonprivate", "dpsgd")
    ]


@pytest.mark.parametrize(
    "args", [["--models", "nope"], ["--methods", "dpsgd"], ["--reps", "0"], ["--block-s", "0"]]
)
def test_bench_models_bad_options_are_one_line(args, tmp_path, capsys):
    from bench import bench_models

    with pytest.raises(SystemExit) as e:
        bench_models.main(args + ["--out", str(tmp_path / "m.csv")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "error:" in err, err
    assert list(tmp_path.iterdir()) == []


def test_bench_routes_protocol(tmp_path):
    """Each route of each layer timed against its weight gradient; the engine's choice named."""
    from bench import bench_routes

    out = tmp_path / "routes.csv"
    assert bench_routes.main(["--quick", "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == len(bench_routes.cases(True))
    for r in rows:
        assert r.keys() == set(bench_routes.COLUMNS)
        assert r["engine"] in bench_routes.ROUTES and r["fastest"] in bench_routes.ROUTES


def test_bench_floor_parts_and_csv(tmp_path):
    """The floor's parts run on the preset's composed shapes; the CSV has a floor row per thread
    count equal to the sum of its parts (timings are not asserted)."""
    from bench import bench_floor

    assert bench_floor.preset_shapes() == {"d": 60, "h": 1000, "L": 600}
    out = tmp_path / "floor.csv"
    args = ["--rows", "600", "--rounds", "1", "--calls", "1", "--threads", "1", "--out", str(out)]
    assert bench_floor.main(args) == 0
    rows = list(csv.DictReader(out.open()))
    assert [r["part"] for r in rows] == bench_floor.PARTS + ["floor"]
    assert all(r.keys() == set(bench_floor.COLUMNS) for r in rows)
    parts = sum(float(r["seconds"]) for r in rows[:-1])
    assert abs(float(rows[-1]["seconds"]) - parts) <= 0.005 + 1e-9  # the sum, rounded to 0.01 s
