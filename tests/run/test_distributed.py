"""torchrun / torch.distributed (dpsgd/run/distributed.py): P processes run the mechanism of one
process.

* a lot's shares are disjoint and their union is the lot;
* with 2 and 4 gloo processes (torch.multiprocessing spawn, file:// rendezvous) every step's global
  lot is the 1-process sampler's lot, the aggregated update's noise has std σC/L per coordinate
  (not √P·σC/L, not σC/(L√P)) with seeded and with secure noise, and parameters stay identical
  on every rank;
* ``torchrun --nproc_per_node=2`` trains the same run as one process: same lots (the sampler's
  generator state), same noise draws (the noise generator's state), the same ledger and metrics, and
  the same final parameters to float32 summation-order tolerance (atol 1e-6 on parameters of size
  ~0.5; the clipped sums differ only in the order of additions);
* a resume with another world size is refused with one line naming it (exit 2);
* (slow) SIGKILL of one rank mid-run leaves the last checkpoint intact and resumable.
"""

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from dpsgd.launch import main as launch
from dpsgd.run.checkpoint import load_checkpoint
from dpsgd.config.schema import validate
from dpsgd.run.distributed import ConfigError, Dist, from_env
from dpsgd.launch.main import compose
from dpsgd.launch.prepare import prepare_resume
from dpsgd.train import train

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which(
    "torchrun"
)
ARGS = [
    "dataset.subset=1200",
    "privacy.lot_size=60",
    "model.hidden=[50]",
    "training.epochs=2",
    "privacy.sigma=2",
    "device=cpu",
    "seed=5",
    "training.eval_batch_size=2000",
]
SIGMA, C, L = 2.0, 0.5, 64.0


def _env():
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def test_shares_partition_the_lot():
    lot = torch.randperm(1000)[:137]
    for P in (1, 2, 3, 4, 7):
        shares = [Dist(r, P, r, "gloo").share(lot) for r in range(P)]
        assert sorted(torch.cat(shares).tolist()) == sorted(lot.tolist())
        assert max(len(s) for s in shares) - min(len(s) for s in shares) <= 1


def test_from_env():
    assert from_env({}) is None
    d = from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert (d.rank, d.world_size, d.local_rank) == (1, 2, 1)
    with pytest.raises(ConfigError, match="RANK=2, WORLD_SIZE=2"):
        from_env({"RANK": "2", "WORLD_SIZE": "2"})


def _noise_once(d, group, res, tag):
    """One DP step on zero gradients with seeded and secure noise: x = 0 gives exactly zero
    gradients, so θ₀ − θ₁ = η·(noise)/L; records its std·L, mean·L, the lot size and whether every
    rank of ``group`` holds the same parameters."""
    import torch.distributed as td

    from dpsgd.run import distributed
    from dpsgd.mechanism.clipping import PerExampleClipper
    from dpsgd.models.networks import MLP
    from dpsgd.mechanism.noise import GaussianNoise
    from dpsgd.mechanism.optim import DPSGD
    from dpsgd.mechanism.plan import Plan

    for secure in (False, True):
        model = MLP(200, (100,), 10, bias=False)  # 21 000 coordinates
        torch.manual_seed(0)
        for p in model.parameters():
            torch.nn.init.normal_(p)
        clipper = PerExampleClipper(model, C, clipping="per_layer", mode="ghost")
        noise = GaussianNoise(seed=None if secure else 123, secure=secure)
        dp = DPSGD(model, clipper, noise, Plan.by_hand(SIGMA, C, L), lr=1.0)
        x, y = torch.zeros(13, 200), torch.zeros(13, dtype=torch.long)
        dp.comm = distributed.Aggregator(
            d, secure, list(clipper.clipped_sum(x[:1], y[:1]).grads), group
        )
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        share = d.share(torch.arange(13))
        out = dp.step(x[share], y[share])
        after = torch.cat([p.detach().flatten() for p in model.parameters()])
        upd = (before - after) * L  # = the noise N(0, σ²C²) if added once
        fps = [None] * d.world_size
        td.all_gather_object(fps, after.detach().cpu().clone(), group=group)
        res[f"{tag}_{secure}"] = {
            "std": float(upd.double().std()),
            "mean": float(upd.double().mean()),
            "lot_size": out["lot_size"],
            "calls": dp.comm.calls,
            "identical": all(torch.equal(f, fps[0]) for f in fps),
        }  # bit-identical


def _worker(rank, init_file, out):
    """One of 4 ranks: per-step lots of the shared sampler; the noise of one step with all 4 ranks
    and with the sub-group of ranks {0, 1}; rank 0 writes what it saw to ``out``."""
    import torch.distributed as td

    from dpsgd.run import distributed
    from dpsgd.mechanism.sampling import PoissonSampler

    torch.set_num_threads(1)
    d = distributed.init(Dist(rank, 4, rank, "?"), init_method=f"file://{init_file}", cuda=False)
    try:
        res = {}
        # every rank's sampler over the whole set, each takes its share: the union per step is the
        # lot of a 1-process sampler with the same seed
        ref = [
            sorted(r.tolist())
            for r in PoissonSampler(500, 40, torch.Generator().manual_seed(11)).epoch()
        ]
        got = []
        for lot in PoissonSampler(500, 40, torch.Generator().manual_seed(11)).epoch():
            parts = [None] * 4
            td.all_gather_object(parts, d.share(lot).tolist())
            got.append(sorted(i for p in parts for i in p))
        res["lots_equal"] = got == ref and len(ref) > 1
        _noise_once(d, None, res, "P4")
        pair = td.new_group([0, 1])  # every rank takes part in creating it
        if rank < 2:
            _noise_once(Dist(rank, 2, rank, d.backend), pair, res, "P2")
        td.barrier()
        if rank == 0:
            Path(out).write_text(json.dumps(res))
    finally:
        distributed.shutdown()


def test_lots_and_noise_once_with_2_and_4_processes(tmp_path):
    out = tmp_path / "res.json"
    # fork: the children inherit the imported modules (a spawn re-imports torch in each of 4
    # processes)
    mp.start_processes(
        _worker, args=(str(tmp_path / "pg"), str(out)), nprocs=4, join=True, start_method="fork"
    )
    res = json.loads(out.read_text())
    assert res["lots_equal"]
    n = 200 * 100 + 100 * 10
    for P in (2, 4):
        for secure in (False, True):
            r = res[f"P{P}_{secure}"]
            # std of n = 21 000 i.i.d. normals: relative sd 1/√(2n) = 0.5 %; ±3 % is > 6 sd, while
            # the wrong scales √P·σC and σC/√P are ≥ 41 % away
            assert abs(r["std"] / (SIGMA * C) - 1) < 0.03, (P, secure, r)
            assert abs(r["mean"]) < 5 * SIGMA * C / n**0.5
            assert r["identical"] and r["lot_size"] == 13  # the global lot size, all-reduced
            assert r["calls"] == 1  # one all-reduce per lot


def _train(args, cwd, n=None):
    cmd = (
        [TORCHRUN, "--standalone", f"--nproc_per_node={n}", "-m", "dpsgd.train"]
        if n
        else [sys.executable, "-m", "dpsgd.train"]
    )
    return subprocess.run(
        cmd + args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300
    )


def _in_process(args, run_dir=None):
    """A 1-process run (or resume=) in this process, as the command line runs it."""
    if run_dir is None:
        c, run_dir, rest = prepare_resume(args)
    else:
        c, rest = validate(compose(args)), args
    launch.run_or_exit(lambda: train(c, run_dir, rest))


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed")
def test_torchrun_two_processes_equal_one_process(tmp_path, capsys):
    two = _train(ARGS + ["hydra.run.dir=two"], tmp_path, n=2)
    assert two.returncode == 0, two.stderr + two.stdout
    _in_process(ARGS, tmp_path / "one")
    a, b = load_checkpoint(tmp_path / "one"), load_checkpoint(tmp_path / "two")
    assert torch.equal(a["sampler"]["generator"], b["sampler"]["generator"])  # the same lots drawn
    assert torch.equal(a["noise"]["state"], b["noise"]["state"])  # the same noise draws
    assert a["ledger"] == b["ledger"] and a["steps"] == b["steps"] > 0
    for k in a["model"]:
        # float32: two processes sum each lot's clipped gradients in another order (all-reduce),
        # ~n·eps32 of the parameters' scale per step
        torch.testing.assert_close(b["model"][k], a["model"][k], rtol=0, atol=1e-6)
    pa, pb = (json.loads((tmp_path / r / "privacy.json").read_text()) for r in ("one", "two"))
    assert pa["distributed"] == {"world_size": 1, "backend": None}
    assert pb["distributed"] == {"world_size": 2, "backend": "gloo"}
    assert pa["epsilon_by_accountant"] == pb["epsilon_by_accountant"]
    ra, rb = (list(csv.DictReader(open(tmp_path / r / "metrics.csv"))) for r in ("one", "two"))
    assert len(ra) == len(rb) == 2
    for x, y in zip(ra, rb):  # the same lots: same lot loss to float32 order; same ε, steps
        assert [x[k] for k in ("epoch", "steps", "epsilon", "epsilon_valid")] == [
            y[k] for k in ("epoch", "steps", "epsilon", "epsilon_valid")
        ]
        assert abs(float(x["lot_loss"]) - float(y["lot_loss"])) < 1e-5
    assert {p.name for p in (tmp_path / "two").iterdir()} == {
        p.name for p in (tmp_path / "one").iterdir()
    } | {".hydra"}
    # a resume with another number of processes is refused in one line naming world_size, unwritten
    before = (tmp_path / "two" / "privacy.json").read_bytes()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        _in_process([f"resume={tmp_path / 'two'}", "training.epochs=3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "world_size=1 differs from the run's world_size=2" in err
    assert (tmp_path / "two" / "privacy.json").read_bytes() == before


def _rank_pids(torchrun_pid):
    """{rank: pid} of torchrun's worker processes (read from /proc)."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != torchrun_pid:
            continue
        for e in env:
            if e.startswith(b"RANK="):
                found[int(e[5:])] = int(d.name)
    return found


@pytest.mark.slow
@pytest.mark.skipif(
    TORCHRUN is None or not sys.platform.startswith("linux"), reason="torchrun, /proc"
)
@pytest.mark.parametrize("victim", [0, 1])
def test_sigkill_one_rank_then_resume(tmp_path, victim):
    args = ARGS + ["training.epochs=6", "hydra.run.dir=run"]
    ref = _train(ARGS + ["training.epochs=6", "hydra.run.dir=ref"], tmp_path, n=2)
    assert ref.returncode == 0, ref.stderr
    proc = subprocess.Popen(
        [TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "dpsgd.train", *args],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    run, deadline = tmp_path / "run", time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if (run / "metrics.csv").is_file() and len(
            (run / "metrics.csv").read_text().splitlines()
        ) >= 3:
            break
        time.sleep(0.02)
    pids = _rank_pids(proc.pid)
    assert victim in pids, pids
    os.kill(pids[victim], signal.SIGKILL)
    assert proc.wait(timeout=120) != 0
    ckpt = load_checkpoint(run)  # verified (content hash): intact
    assert ckpt is not None and not ckpt["complete"] and ckpt["distributed"]["world_size"] == 2
    r = _train([f"resume={run}"], tmp_path, n=2)
    assert r.returncode == 0, r.stderr
    done, want = load_checkpoint(run), load_checkpoint(tmp_path / "ref")
    assert done["complete"] and done["steps"] == want["steps"]

    # a seeded replay on the same setup: every lot proved by its digest on both ranks is charged
    # once; what the dead attempt reserved but never digested (the lot in flight, the rest of its
    # chunk) is lost
    def by_kind(ledger, labels):
        out = {}
        for e in ledger["entries"]:
            if e["label"] in labels:
                key = tuple((k, v) for k, v in sorted(e.items()) if k != "count")
                out[key] = out.get(key, 0) + e["count"]
        return out

    assert by_kind(done["ledger"], ("pca", "sgd")) == by_kind(
        want["ledger"], ("pca", "sgd", "lost")
    )
    lost = sum(e["count"] for e in done["ledger"]["entries"] if e["label"] == "lost")
    st = json.loads((run / "privacy.json").read_text())
    assert (
        lost == sum(r["lost_lots_charged"] for r in st["resumes"]) <= want["steps"] // 6
    )  # ≤ an epoch
    for k in want["model"]:
        # a bit-identical replay (the same process count, seeds and lots on this machine)
        torch.testing.assert_close(done["model"][k], want["model"][k], rtol=0, atol=0)  # exact
