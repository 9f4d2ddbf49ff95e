"""The step benchmark's protocol runs end to end (tiny settings; timings are never asserted)."""
import csv
import sys

import pytest

from bench import bench_step


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memory children read /proc")
def test_bench_step_processes_aggregate(tmp_path):
    out = tmp_path / "bench.csv"
    bench_step.main(["--processes", "2", "--models", "mnist_pca60_mlp1000", "--methods",
                     "nonprivate,dpsgd_ghost", "--reps", "2", "--warmup", "0", "--block-s", "0.01",
                     "--lot", "64", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert [r["method"] for r in rows] == ["nonprivate", "dpsgd_ghost"]
    assert all(r.keys() == set(bench_step.COLUMNS) for r in rows)
    for r in rows:
        assert r["processes"] == "2" and int(r["steps_per_rep"]) >= 1
        assert float(r["ratio_min"]) <= float(r["ratio_to_nonprivate"]) <= float(r["ratio_max"])
        assert float(r["examples_per_s"]) > 0 and float(r["peak_mem_mb"]) >= 0
    assert float(rows[0]["ratio_to_nonprivate"]) == 1.0


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
    assert len(rows) == len(bench_gemm.SHAPES) and all(r.keys() == set(bench_gemm.COLUMNS) for r in rows)
    assert {r["engine_uses"] for r in rows} == {"direct", "transposed"}


def test_bench_distributed_protocol(tmp_path):
    """1 plain process and 2 gloo ranks (forked) step real lots; the CSV has its columns."""
    from bench import bench_distributed

    out = tmp_path / "dist.csv"
    bench_distributed.main(["--lots", "32", "--processes", "2", "--steps", "1", "--reps", "1",
                            "--subset", "1000", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert [(r["mode"], r["processes"]) for r in rows] == [("plain", "1"), ("torch.distributed", "2")]
    assert all(r.keys() == set(bench_distributed.COLUMNS) for r in rows)
    assert int(rows[1]["allreduce_bytes"]) == 4 * (60 * 1000 + 1000 * 10 + 2)
    assert float(rows[1]["examples_per_s"]) > 0 and 0 <= float(rows[1]["allreduce_share"])
