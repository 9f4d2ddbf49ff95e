"""Bad input is refused before any work (brief, house style 10; issue 6 item 5).

Every case runs the real CLI as a subprocess — ``python -m dpsgd.train <overrides>`` or
``python -m dpsgd.privacy <args>`` — in its own working directory that already holds earlier
outputs, and must:

* exit with code 2,
* print exactly one line to stderr, ``error: <message>`` (the privacy CLI prefixes its program
  name, argparse style), naming the offending key,
* leave every pre-existing file byte-identical and create nothing (no new run dir).

The cases run in parallel (a thread pool over subprocesses) to keep the table fast.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 180


@dataclass
class Case:
    id: str
    cli: str                      # "train" | "privacy"
    args: list[str]               # "{run}", "{tmp}", "{empty}" are filled in by the fixture
    key: str                      # must appear in the one-line error
    env: dict = field(default_factory=dict)


# A valid, tiny training configuration: each bad case changes one thing.
TINY = ["dataset.subset=600", "privacy.lot_size=60", "privacy.physical_batch_size=60", "model.hidden=[8]",
        "model.pca_dims=10", "training.epochs=1", "training.max_steps=2", "training.eval_batch_size=1000"]
NO_DATA = {"DPSGD_DATA_ROOT": "{tmp}/empty_root", "DPSGD_DATA_SOURCE": "{tmp}/empty_source",
           # any download attempt fails at once: the proxy is a closed local port
           "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "no_proxy": ""}

CASES = [
    # --- privacy parameters
    Case("negative_sigma", "train", ["privacy.sigma=-1"], "privacy.sigma"),
    Case("zero_sigma_private", "train", ["privacy.sigma=0"], "privacy.sigma"),
    Case("string_sigma", "train", ["privacy.sigma=four"], "privacy.sigma"),
    Case("zero_clip_norm", "train", ["privacy.clip_norm=0"], "privacy.clip_norm"),
    Case("delta_one", "train", ["privacy.delta=1"], "privacy.delta"),
    Case("lot_larger_than_dataset", "train", ["privacy.lot_size=60001"], "privacy.lot_size"),
    Case("secure_rng_with_noise_seed", "train", ["privacy.secure_rng=true", "privacy.noise_seed=3"],
         "privacy.noise_seed"),
    Case("nonpositive_target_eps", "train", ["privacy.target_epsilon=-1"], "privacy.target_epsilon"),
    Case("unknown_sampling", "train", ["privacy.sampling=uniform"], "privacy.sampling"),
    Case("unknown_privacy_key", "train", ["+privacy.sigmaa=4"], "privacy.sigmaa"),
    # --- accountant, dataset, model
    Case("unknown_accountant", "train", ["accountant=gdp"], "accountant"),
    Case("unknown_dataset", "train", ["dataset=imagenet"], "dataset"),
    Case("pca_wider_than_input", "train", ["model.pca_dims=1000"], "model.pca_dims"),
    Case("cnn_on_mnist", "train", ["model.name=cnn"], "model.name"),
    # --- training
    Case("nan_lr", "train", ["training.lr=nan"], "training.lr"),
    Case("non_integer_epochs", "train", ["training.epochs=1.5"], "training.epochs"),
    # --- data: missing, with no network
    Case("missing_data_no_download", "train", TINY + ["dataset.download=false"], "dataset.root", env=NO_DATA),
    Case("missing_data_download_fails", "train", TINY, "dataset.root", env=NO_DATA),
    # --- outputs and resume
    Case("existing_run_dir", "train", TINY + ["hydra.run.dir={tmp}/outputs/old"], "hydra.run.dir"),
    Case("unknown_resume_dir", "train", ["resume={tmp}/no_such_run"], "resume"),
    Case("resume_dir_not_a_run", "train", ["resume={tmp}/outputs"], "resume"),
    Case("resume_changed_sigma", "train", ["resume={run}", "privacy.sigma=2"], "privacy.sigma"),
    Case("resume_changed_lot", "train", ["resume={run}", "privacy.lot_size=30"], "privacy.lot_size"),
    Case("resume_changed_dataset", "train", ["resume={run}", "dataset=fashion_mnist"], "dataset.name"),
    # --- the privacy CLI
    Case("privacy_q_above_one", "privacy", ["--q", "1.5", "--sigma", "4", "--epochs", "10"], "q"),
    Case("privacy_negative_sigma", "privacy", ["--q", "0.01", "--sigma", "-1", "--epochs", "10"], "sigma"),
    Case("privacy_nan_sigma", "privacy", ["--q", "0.01", "--sigma", "nan", "--epochs", "10"], "sigma"),
    Case("privacy_delta_one", "privacy", ["--q", "0.01", "--sigma", "4", "--epochs", "10", "--delta", "1"],
         "delta"),
    Case("privacy_negative_epochs", "privacy", ["--q", "0.01", "--sigma", "4", "--epochs", "-3"], "epochs"),
]


def _snapshot(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file (and '<dir>' for every directory) under root.

    Empty folders inside the (empty) data root are ignored: torchvision creates <root>/MNIST/raw
    before its download attempt fails; no file is written there.
    """
    snap = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_dir():
            if not rel.startswith("empty_root/"):
                snap[rel] = "<dir>"
        else:
            snap[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return snap


def _fill(s: str, subs: dict) -> str:
    for k, v in subs.items():
        s = s.replace("{" + k + "}", str(v))
    return s


def _env(extra: dict, subs: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}   # e.g. HYDRA_FULL_ERROR
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update({k: _fill(v, subs) for k, v in extra.items()})
    return env


def _cli(cli: str, args: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"dpsgd.{cli}", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    base = tmp_path_factory.mktemp("bad_input")
    run = base / "run0"

    def make_run():
        """A real (tiny) finished run to resume from; returns its snapshot."""
        made = _cli("train", TINY + [f"hydra.run.dir={run}"], base, _env({}, {}))
        assert made.returncode == 0, f"could not make a run to resume:\n{made.stderr[-2000:]}"
        return _snapshot(run)

    def play(case: Case, run_ready):
        tmp = base / case.id
        (tmp / "outputs" / "old").mkdir(parents=True)
        (tmp / "outputs" / "old" / "metrics.csv").write_text("epoch,loss\n1,0.5\n")
        (tmp / "empty_root").mkdir()
        (tmp / "empty_source").mkdir()
        if any("{run}" in a for a in case.args):
            run_ready.result()
        subs = {"run": run, "tmp": tmp}
        before = _snapshot(tmp)
        res = _cli(case.cli, [_fill(a, subs) for a in case.args], tmp, _env(case.env, subs))
        return res, before, _snapshot(tmp)

    # the run to resume is made while the other cases run; cases that resume it are queued last
    ordered = sorted(CASES, key=lambda c: any("{run}" in a for a in c.args))
    with ThreadPoolExecutor(max_workers=min(4, (os.cpu_count() or 2) + 1)) as pool:
        run_ready = pool.submit(make_run)
        futures = {c.id: pool.submit(play, c, run_ready) for c in ordered}
        results = {k: f.result() for k, f in futures.items()}
        results["__run__"] = (run_ready.result(), _snapshot(run))
    return results


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_refused_before_training(outcomes, case):
    res, before, after = outcomes[case.id]
    err = res.stderr.strip()
    assert res.returncode == 2, f"exit {res.returncode}; stderr: {err[-1500:]}"
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err[-1500:]}"
    # train: "error: <message>"; privacy (argparse style): "python -m dpsgd.privacy: error: <message>"
    assert lines[0].startswith("error: ") if case.cli == "train" else "error: " in lines[0], lines[0]
    assert case.key in lines[0], f"error does not name {case.key!r}: {lines[0]}"
    assert after == before, "existing outputs changed or new files appeared"


def test_resumed_run_untouched(outcomes):
    before, after = outcomes["__run__"]
    assert after == before, "a refused resume modified the run directory"


def test_table_is_large_enough():
    assert len(CASES) >= 20
    assert len({c.id for c in CASES}) == len(CASES)
