"""Every torchrun rank agrees on the whole run before the first lot
(dpsgd/run/distributed.py:agree_on).

* the comparison: the first item (in rank 0's order) on which a rank differs is named, with both
  values; a rank's refusal wins; tensors agree only when bit-identical;
* default deny: every key of the validated Config is compared except the explicit ``PER_RANK`` list,
  and changing any compared key is named;
* two gloo processes (fork, file:// rendezvous) raise the same line on both ranks, a rank that
  cannot build its run before the exchange stops every rank with its line, and one that fails
  reading after it is named to the others (``agree``);
* two nodes started with different command lines (two ``python -m dpsgd.train`` processes joined by
  the torch.distributed environment, as torchrun's agents would start them): both exit 2 with the
  same line naming ``privacy.clip_norm``, and no run folder is left.
"""

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

from dpsgd.config.schema import validate
from dpsgd.launch import main as launch
from dpsgd.run import distributed
from dpsgd.run.distributed import (
    PER_RANK,
    REFUSED,
    Dist,
    RanksDisagree,
    canonical,
    config_items,
    first_difference,
    flat_items,
    state_items,
)

REPO = Path(__file__).resolve().parents[2]
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


def test_first_difference_names_the_first_key_in_rank_0s_order():
    every = [
        {"a": "1", "b": "2", "c": "3"},
        {"a": "1", "b": "2", "c": "3"},
        {"a": "1", "c": "4", "b": "5"},
        {"a": "1", "b": "6", "c": "3"},
    ]
    assert first_difference(every) == "ranks disagree on b: rank 0 has 2, rank 2 has 5"
    assert first_difference(every[:2]) is None
    assert (
        first_difference([{"a": "1"}, {"a": "1", "z": "0"}])
        == "ranks disagree on z: rank 0 has (no such key), rank 1 has 0"
    )


def test_a_refusal_wins_and_names_its_rank():
    ok = {"a": "1"}
    assert (
        first_difference([ok, {REFUSED: "privacy.clip_norm=abc: must be a number"}, ok])
        == "rank 1: privacy.clip_norm=abc: must be a number"
    )
    assert (
        first_difference([{REFUSED: "resume=x: no such run directory"}, {REFUSED: "other"}])
        == "resume=x: no such run directory"
    )


def test_every_config_key_is_compared_but_the_per_rank_ones():
    c = validate({"privacy": {"sigma": 4.0, "lot_size": 600}})
    every_key = set(flat_items(c.to_dict()))
    assert PER_RANK < every_key  # the exclusions name real keys (none goes stale)
    items = config_items(c)
    assert set(items) == every_key - PER_RANK
    # default deny: changing any compared key is named; the per-rank keys are ignored
    ref = canonical(items)
    for k in every_key:
        other = dict(items, **{k: ["changed"]}) if k not in PER_RANK else items
        msg = first_difference([ref, canonical(other)])
        assert (msg is None) == (k in PER_RANK), k
        assert msg is None or msg.startswith(f"ranks disagree on {k}: rank 0 has "), msg
    moved = dataclasses.replace(
        c, dataset=dataclasses.replace(c.dataset, root="/elsewhere", download=False)
    )
    assert first_difference([ref, canonical(config_items(moved))]) is None


def test_command_lines_that_mean_the_same_run_agree_and_others_are_named():
    """The ranks compare the validated Config, not the text of their command lines: another spelling
    of a number, another order or a default given explicitly is the same run; another value is
    not."""

    def items(*overrides):
        return canonical(config_items(validate(launch.compose(list(overrides)))))

    ref = items("privacy.sigma=4", "privacy.lot_size=600")
    assert first_difference([ref, items("privacy.lot_size=600", "privacy.sigma=4.0")]) is None
    assert (
        first_difference([ref, items("privacy.sigma=4", "privacy.lot_size=600", "seed=0")]) is None
    )
    assert (
        first_difference([ref, items("privacy.sigma=4", "privacy.lot_size=601")])
        == "ranks disagree on privacy.lot_size: rank 0 has 600, rank 1 has 601"
    )


def test_tensors_agree_only_when_bit_identical():
    x = torch.linspace(0, 1, 1000)
    y = x.clone()
    y[500] = torch.nextafter(y[500], torch.tensor(2.0))  # one ulp in one entry
    a = canonical(state_items({"X_train": x}, {"model": {"w": torch.ones(3)}}, {"steps": 4}))
    b = canonical(state_items({"X_train": y}, {"model": {"w": torch.ones(3)}}, {"steps": 4}))
    assert list(a) == ["data.X_train", "state.model.w", "progress.steps"]
    msg = first_difference([a, b])
    assert msg.startswith("ranks disagree on data.X_train: rank 0 has tensor float32[1000] sha256 ")
    assert (
        first_difference(
            [
                a,
                canonical(
                    state_items(
                        {"X_train": x.clone()}, {"model": {"w": torch.ones(3)}}, {"steps": 4}
                    )
                ),
            ]
        )
        is None
    )
    assert (
        first_difference([a, dict(a, **canonical({"progress.steps": 5}))])
        == "ranks disagree on progress.steps: rank 0 has 4, rank 1 has 5"
    )


def test_other_ranks_read_their_overrides_as_rank_0s_hydra_job_does():
    """Rank 0's overrides come from its Hydra job (interpolations resolved, Hydra's settings left
    out); another rank reads its command line the same way, so one command line agrees with
    itself."""
    seen = []
    launch._follow(
        lambda c, run_dir, overrides: seen.append((c, overrides)),
        ARGS + ["training.lr=${privacy.clip_norm}", "hydra.run.dir=x"],
        "x",
    )
    ((c, overrides),) = seen
    assert overrides == ARGS + [f"training.lr={c.privacy.clip_norm}"]


def _agree_worker(rank, init_file, out):
    torch.set_num_threads(1)
    distributed.init(Dist(rank, 2, rank, "?"), init_method=f"file://{init_file}", cuda=False)
    res = {}
    try:
        distributed.agree_on({"seed": 5, "w": torch.ones(4)})  # the same: no error
        res["same"] = "ok"
        try:  # a longer payload on rank 1
            distributed.agree_on(
                {
                    "seed": 5,
                    "privacy.clip_norm": 4.0 if rank == 0 else 1000.0,
                    "extra": "x" * 100 * rank,
                }
            )
        except RanksDisagree as e:
            res["differ"] = str(e)
    finally:
        distributed.shutdown()
    distributed.init(Dist(rank, 2, rank, "?"), init_method=f"file://{init_file}.2", cuda=False)
    try:  # rank 1 refused before the exchange; rank 0 reached it
        if rank == 1:
            distributed.join_refusal(
                distributed.ConfigError("privacy.clip_norm=abc: must be a number")
            )
        distributed.agree_on({"seed": 5})
    except RanksDisagree as e:
        res["refused"] = str(e)
    try:  # after the exchange: rank 1 fails reading; rank 0 is told why
        distributed.agree(
            None if rank == 0 else distributed.ConfigError("checkpoint.pt: unreadable here")
        )
    except distributed.ConfigError as e:
        res["after"] = f"{type(e).__name__}: {e}"
    finally:
        distributed.shutdown()
    Path(f"{out}.{rank}").write_text(json.dumps(res))


def test_two_gloo_ranks_stop_with_the_same_line(tmp_path):
    out = tmp_path / "res"
    mp.start_processes(
        _agree_worker,
        args=(str(tmp_path / "pg"), str(out)),
        nprocs=2,
        join=True,
        start_method="fork",
    )
    r0, r1 = (json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1))
    after = r0.pop("after"), r1.pop("after")
    assert after == (
        "PeerRefused: rank 1 refused the run: checkpoint.pt: unreadable here",
        "ConfigError: checkpoint.pt: unreadable here",
    )
    assert r0 == r1
    assert r0["same"] == "ok"
    assert r0["differ"] == "ranks disagree on privacy.clip_norm: rank 0 has 4.0, rank 1 has 1000.0"
    assert r0["refused"] == "rank 1: privacy.clip_norm=abc: must be a number"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_with_different_command_lines_stop_before_writing(tmp_path):
    """Each rank its own command line, as two nodes would be started: nothing trains, nothing is
    written."""
    port, run = _free_port(), tmp_path / "run"
    procs = []
    for rank, extra in ((0, []), (1, ["privacy.clip_norm=1000"])):
        env = dict(
            os.environ,
            PYTHONPATH=str(REPO),
            OMP_NUM_THREADS="1",
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "dpsgd.train", *ARGS, f"hydra.run.dir={run}", *extra],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=240) for p in procs]
    want = "error: ranks disagree on privacy.clip_norm: rank 0 has 4.0, rank 1 has 1000.0\n"
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 2, err
        assert err == want and out == ""
    assert not run.exists()
