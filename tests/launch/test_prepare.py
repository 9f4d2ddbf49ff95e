"""Bad input is refused before any work, with one line naming the offending key.

Three tables:

* ``VALIDATION``: the train CLI's overrides, checked in-process by ``dpsgd.train.prepare(args)``
  (what ``python -m dpsgd.train`` runs before Hydra creates anything): ``ConfigError``, one line,
  naming the key, nothing written in the working directory.
* ``PRIVACY_CLI``: ``dpsgd.privacy.main(argv)`` in-process: ``SystemExit(2)`` and one stderr line
  naming the parameter.
* ``PROCESS``: real subprocesses, only where the behaviour is about processes, files or exit codes:
  missing data with no network, an existing run dir, resuming a real run with a changed σ, and three
  end-to-end representatives of the tables above (``test_refused_before_training`` says what each
  case must do).

Resuming that real run with another L or dataset is refused in-process too (``RESUME``).
``test_every_checked_key_has_a_refusal_case`` computes the table's coverage.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args, get_type_hints

import pytest

from dpsgd import privacy
from dpsgd.accountant import limits as acc_limits
from dpsgd.config.schema import CHOICES, GROUPS, Config, ConfigError
from dpsgd.launch.prepare import prepare, prepare_resume

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 180


@dataclass
class Bad:
    args: list[str]
    key: str  # the config key refused: the one-line message must name it
    expect: str | None = None  # more of the message, where the reason matters


VALIDATION = [
    # --- dataset
    Bad(["dataset=imagenet"], "dataset"),  # Hydra: no such group option
    Bad(["dataset=svhn"], "dataset=svhn"),
    Bad(["dataset.name=imagenet"], "dataset.name", "dataset.name=imagenet: unknown"),
    Bad(["dataset.subset=0"], "dataset.subset"),
    Bad(["dataset.subset=60001"], "dataset.subset", "must be <= 60000"),
    Bad(["dataset.validation=60000"], "dataset.validation", "must be <= 59999"),
    Bad(["dataset.crop=0"], "dataset.crop"),
    Bad(["dataset.crop=33"], "dataset.crop"),
    Bad(
        ["dataset=imagefolder", "dataset.train=/", "dataset.test=/", "dataset.image_size=0"],
        "dataset.image_size",
    ),  # fmt: skip
    Bad(["+dataset.dtype=int64"], "dataset.dtype", "dataset=tensors|csv only (token ids)"),
    Bad(["dataset.download=maybe"], "dataset.download", "must be true or false"),
    Bad(["dataset.root=5"], "dataset.root", "must be a path"),
    Bad(["dataset.augment=rotate"], "dataset.augment"),
    Bad(["dataset.augment=crop_flip"], "dataset.augment", "random crops need images"),
    Bad(["dataset.standardize=maybe"], "dataset.standardize", "must be true or false"),
    Bad(["dataset.standardize=true"], "dataset.standardize", "for image datasets"),
    # --- model
    Bad(["model.name=resnet"], "model.name", "unknown"),
    Bad(["model=custom"], "model._target_", "model=custom needs your network's class"),
    Bad(["model.name=cnn"], "model.name", "model.name=cnn: needs 3x24x24 images"),
    Bad(["model=cnn"], "model.name", "model.name=cnn"),
    Bad(["model.hidden=1000"], "model.hidden", "must be a list"),
    Bad(["model.hidden=[1000,0]"], "model.hidden", "model.hidden[1]"),
    Bad(
        ["model.hidden=[2000000000]"],
        "model.hidden",
        "model.hidden[0]=2000000000: a layer this wide",
    ),
    Bad(["model.hidden=[100000000]"], "model.hidden", "parameters (mlp), more than PARAMS_MAX"),
    Bad(["model.bias=yes"], "model.bias"),
    Bad(["model.projection=svd"], "model.projection"),
    Bad(["model.init=xavier"], "model.init"),
    Bad(["model.norm=batch"], "model.norm", "unknown"),
    Bad(["model.norm=group"], "model.norm", "only model.name=tanh_cnn"),
    Bad(["model=tanh_cnn", "dataset=cifar10"], "model.name", "tanh_cnn: needs 1x28x28 images"),
    Bad(["model.freeze=all"], "model.freeze"),
    Bad(["model.freeze=features"], "model.freeze", "the mlp model has no such parameters"),
    Bad(["model.trainable=weights"], "model.trainable", "'weights' is not one of"),
    Bad(["model.trainable=bias"], "model.trainable", "the model has no bias parameters"),
    Bad(["model.lora_rank=0"], "model.lora_rank", "must be >= 1"),
    Bad(["model.lora_rank=2.5"], "model.lora_rank", "must be an integer"),
    Bad(["model.lora_alpha=0"], "model.lora_alpha", "must be > 0"),
    Bad(
        ["experiment=cifar10_eps2", "model.pretrained=null"],
        "model.freeze",
        "freezes public weights",
    ),
    Bad(
        ["experiment=cifar10_eps2", "model.pretrained=none.pt"],
        "model.pretrained",
        "model.pretrained=none.pt",  # the CIFAR data named first where they are missing too
    ),
    Bad(["model.features=wavelets"], "model.features"),
    Bad(
        [
            "model.name=linear",
            "model.projection=none",
            "model.features=scatter",
            "model.feature_norm=batch",
        ],
        "model.feature_norm",
    ),
    Bad(
        [
            "model.name=linear",
            "model.projection=none",
            "model.features=scatter",
            "model.feature_groups=4",
        ],
        "model.feature_groups",
        "must divide the 81 feature channels",
    ),
    Bad(
        ["model.pca_dims=785"], "model.pca_dims", "model.pca_dims=785: exceeds the input dimension"
    ),
    Bad(["model.pca_dims=-1"], "model.pca_dims"),
    # --- privacy
    Bad(["privacy.private=1"], "privacy.private"),
    Bad(["privacy.sigma=-1"], "privacy.sigma", "privacy.sigma=-1.0: must be >= 0"),
    Bad(["privacy.sigma=0"], "privacy.sigma", "privacy.sigma=0.0: a private run needs noise"),
    Bad(["privacy.sigma=four"], "privacy.sigma"),
    Bad(["privacy.sigma=nan"], "privacy.sigma"),
    Bad(["privacy.sigma=1e308"], "privacy.sigma", "SIGMA_MAX"),
    Bad(["privacy.sigma=1e-300"], "privacy.sigma", "SIGMA_MIN"),
    Bad(["privacy.sigma_p=-0.5"], "privacy.sigma_p"),
    Bad(["privacy.sigma_p=0"], "privacy.sigma_p", "privacy.sigma_p=0.0"),
    Bad(["privacy.sigma_p=0.001"], "privacy.sigma_p", "SIGMA_MIN"),
    Bad(["privacy.sigma_p=1e7"], "privacy.sigma_p", "SIGMA_MAX"),
    Bad(["privacy.clip_norm=0"], "privacy.clip_norm"),
    Bad(["privacy.clip_norm=-4"], "privacy.clip_norm"),
    Bad(["privacy.clip_norm=inf"], "privacy.clip_norm"),
    Bad(
        ["privacy.lot_size=60001"], "privacy.lot_size", "privacy.lot_size=60001: must be <= N=60000"
    ),
    Bad(["dataset.subset=1000", "privacy.lot_size=1001"], "privacy.lot_size", "N=1000"),
    Bad(["privacy.lot_size=0"], "privacy.lot_size"),
    Bad(["privacy.delta=0"], "privacy.delta"),
    Bad(["privacy.delta=1"], "privacy.delta"),
    Bad(["privacy.delta=1e-101"], "privacy.delta", "must be >= 1e-100"),
    Bad(["privacy.delta=0.5"], "privacy.delta", "must be < 1/N = 1.667e-05 (N=60000"),
    Bad(
        ["dataset.subset=600", "privacy.delta=0.002"],
        "privacy.delta",
        "privacy.allow_large_delta=true",
    ),
    Bad(["privacy.allow_large_delta=sure"], "privacy.allow_large_delta"),
    Bad(["privacy.clipping=perlayer"], "privacy.clipping", "privacy.clipping=perlayer: unknown"),
    Bad(["privacy.convention=paper"], "privacy.convention"),
    Bad(["privacy.sampling=uniform"], "privacy.sampling"),
    Bad(
        ["privacy.max_lot_size=700"],
        "privacy.max_lot_size",
        "applies to privacy.sampling=truncated_poisson only",
    ),
    Bad(
        ["privacy.sampling=truncated_poisson", "accountant=pld", "privacy.max_lot_size=500"],
        "privacy.max_lot_size",
        "must be >= 600",
    ),
    Bad(
        ["privacy.sampling=truncated_poisson", "accountant=pld"],
        "privacy.max_lot_size",
        "needs the cap B",
    ),
    Bad(["privacy.sampling=fixed_size"], "accountant.name", "accounted by pld or rdp only"),
    Bad(["privacy.sampling=balls_in_bins"], "accountant.name", "accounted by pld or rdp only"),
    Bad(["privacy.grad_sample_mode=jax"], "privacy.grad_sample_mode"),
    Bad(["privacy.noise=laplace"], "privacy.noise"),
    Bad(["privacy.bands=4"], "privacy.bands", "applies to privacy.noise=bandmf only"),
    Bad(["privacy.noise=bandmf"], "privacy.bands", "needs the number of bands"),
    Bad(["privacy.noise=bandmf", "privacy.bands=0"], "privacy.bands"),
    Bad(["privacy.noise=bandmf", "privacy.bands=101"], "privacy.bands", "b·L <= N"),
    Bad(
        ["privacy.noise=bandmf", "privacy.bands=200", "privacy.sampling=cyclic"],
        "privacy.bands",
        "needs b <= 100",
    ),
    Bad(
        ["privacy.noise=bandmf", "privacy.bands=4", "privacy.sampling=shuffle"],
        "privacy.sampling",
        "accounted only under cyclic",
    ),
    Bad(["privacy.noise=blt", "privacy.sampling=cyclic_poisson"], "privacy.sampling", "not banded"),
    Bad(["privacy.sampling=cyclic"], "privacy.sampling", "correlated noise"),
    Bad(["privacy.noise=blt", "privacy.blt_buffers=0"], "privacy.blt_buffers"),
    Bad(["privacy.noise=blt", "privacy.private=false"], "privacy.noise", "non-private"),
    Bad(["privacy.secure_rng=2"], "privacy.secure_rng"),
    Bad(["privacy.secure_rng=true", "privacy.noise_seed=3"], "privacy.noise_seed", "refused with"),
    Bad(["privacy.noise_seed=-1"], "privacy.noise_seed"),
    Bad(["privacy.target_epsilon=-1"], "privacy.target_epsilon"),
    Bad(["privacy.target_epsilon=0"], "privacy.target_epsilon"),
    Bad(["privacy.target_epsilon=1e5"], "privacy.target_epsilon", "must be <= 10000"),
    Bad(["privacy.target_epsilon=0.5"], "privacy.target_epsilon", "the DP-PCA release alone costs"),
    Bad(
        ["experiment=mnist_nonprivate", "privacy.target_epsilon=2"],
        "privacy.target_epsilon",
        "non-private",
    ),
    Bad(["privacy.physical_batch_size=0"], "privacy.physical_batch_size"),
    Bad(["privacy.physical_batch_size=60001"], "privacy.physical_batch_size", "must be <= 60000"),
    Bad(["privacy.pca_fraction=1.5"], "privacy.pca_fraction"),
    Bad(
        ["privacy.calibrate_sigma=true"], "privacy.calibrate_sigma", "needs privacy.target_epsilon"
    ),
    Bad(
        [f"privacy.pca_fraction={acc_limits.Q_MIN / 10:g}"],
        "privacy.pca_fraction",
        f"must be >= {acc_limits.Q_MIN}",
    ),
    Bad(["privacy.augment_multiplicity=0"], "privacy.augment_multiplicity", "must be >= 1"),
    Bad(["privacy.augment_multiplicity=1.5"], "privacy.augment_multiplicity", "must be an integer"),
    Bad(["+privacy.sigmaa=4"], "privacy.sigmaa", "unknown config key"),
    Bad(["privacy.sigmaa=1"], "privacy.sigmaa"),  # Hydra: not in the struct
    # --- accountant
    Bad(["accountant=gdp"], "accountant"),
    Bad(["accountant.name=gdp"], "accountant.name"),
    # --- training
    Bad(["training.epochs=1.5"], "training.epochs", "must be an integer"),
    Bad(["training.epochs=-1"], "training.epochs"),
    Bad(["training.epochs=ten"], "training.epochs"),
    Bad(
        ["privacy.lot_size=1", "training.epochs=16667"],
        "training.epochs",
        "1000020000 lots (poisson sampling, L=1, N=60000) exceed STEPS_MAX",
    ),
    Bad(["training.lr=nan"], "training.lr", "training.lr=nan"),
    Bad(["training.lr=inf"], "training.lr"),
    Bad(["training.lr=0"], "training.lr"),
    Bad(["training.lr_end=-0.1"], "training.lr_end"),
    Bad(["training.lr_saturate_epochs=-1"], "training.lr_saturate_epochs"),
    Bad(["training.momentum=1"], "training.momentum", "must be < 1"),
    Bad(["training.max_steps=0"], "training.max_steps"),
    Bad(["training.max_steps=10000000000"], "training.max_steps", "must be <= 1000000000"),
    Bad(["training.eval_every=0"], "training.eval_every"),
    Bad(["training.eval_batch_size=0"], "training.eval_batch_size"),
    Bad(["training.checkpoint_every=-1"], "training.checkpoint_every"),
    Bad(["training.ema_decay=1"], "training.ema_decay", "must be < 1"),
    Bad(["training.ema_decay=0"], "training.ema_decay", "must be > 0"),
    Bad(["training.train_metrics=sometimes"], "training.train_metrics", "must be true or false"),
    Bad(["training.schedule=step"], "training.schedule", "unknown, must be one of"),
    Bad(["training.precision=fp16"], "training.precision", "unknown, must be one of"),
    # --- optimizer
    Bad(["optimizer=lion"], "optimizer"),
    Bad(["optimizer.name=lion"], "optimizer.name", "unknown, must be one of"),
    Bad(["optimizer=adam", "optimizer.betas=[0.9,1.0]"], "optimizer.betas", "must be < 1"),
    Bad(["optimizer=adam", "optimizer.eps=0"], "optimizer.eps", "must be > 0"),
    Bad(["optimizer=adamw", "optimizer.weight_decay=-1"], "optimizer.weight_decay"),
    Bad(["optimizer.weight_decay=0.1"], "optimizer.weight_decay", "optimizer=sgd is DP-SGD"),
    Bad(["optimizer=adam", "training.momentum=0.9"], "training.momentum", "has its own"),
    Bad(["optimizer=custom"], "optimizer._target_", "builds the class"),
    Bad(
        ["optimizer=custom", "optimizer._target_=torch.nn.Linear"],
        "optimizer._target_",
        "not a torch.optim.Optimizer",
    ),
    # --- logger
    Bad(["logger=mlflow"], "logger"),
    Bad(["logger.name=mlflow"], "logger.name", "unknown, must be one of"),
    Bad(["logger.project=a/b"], "logger.project", "must be a non-empty name"),
    # --- top level
    Bad(["seed=-1"], "seed"),
    Bad(["device=tpu"], "device"),
    Bad(["tf32=sometimes"], "tf32"),
    Bad(["name=a/b"], "name"),
    Bad(["name=" + "n" * 300], "name", "a folder name is 300 bytes, longer than the file system's"),
    Bad(["hydra.run.dir=out/" + "d" * 300 + "/run"], "hydra.run.dir", "a folder name is 300 bytes"),
    Bad(["resume=/nonexistent/run"], "resume", "resume=/nonexistent/run: no such run directory"),
    Bad(["resume=."], "resume", "not a dpsgd run directory"),
    Bad(["hydra.run.dir=out/${nope}"], "hydra.run.dir", "not found"),
    # --- hydra launcher (sweeps; dpsgd/launch/launchers.py)
    Bad(["hydra/launcher=slurmm"], "hydra/launcher=slurmm"),
    Bad(["hydra/launcher=joblib", "hydra.launcher.n_jobs=0"], "hydra.launcher.n_jobs"),
    Bad(
        ["hydra/launcher=slurm", "hydra.launcher.tasks_per_node=2"],
        "hydra.launcher.tasks_per_node",
        "must be 1",
    ),
]

PRIVACY_CLI = [
    Bad(["--q", "1.5", "--sigma", "4", "--epochs", "10"], "q"),
    Bad(["--q", "0.01", "--sigma", "-1", "--epochs", "10"], "sigma"),
    Bad(["--q", "0.01", "--sigma", "nan", "--epochs", "10"], "sigma"),
    Bad(["--q", "0.01", "--sigma", "4", "--epochs", "10", "--delta", "1"], "delta"),
    Bad(["--q", "0.01", "--sigma", "4", "--epochs", "-3"], "epochs"),
    Bad(
        [
            "--N",
            "60000",
            "--L",
            "600",
            "--sigma",
            "4",
            "--steps",
            "100",
            "--sampler",
            "poisson",
            "--B",
            "700",
        ],
        "B=700",
        "applies to --sampler truncated_poisson only",
    ),
    Bad(
        [
            "--N",
            "60000",
            "--L",
            "600",
            "--sigma",
            "4",
            "--steps",
            "100",
            "--sampler",
            "shuffle",
            "--B",
            "700",
        ],
        "B=700",
    ),
    Bad(["--q", "0.01", "--sigma", "4", "--epochs", "10", "--B", "700"], "B=700"),
    Bad(["--q", "0.01", "--sigma", "4", "--steps", "10", "--noise", "bandmf"], "--bands b"),
    Bad(["--q", "0.01", "--sigma", "4", "--steps", "10", "--bands", "3"], "bands=3"),
    Bad(
        ["--q", "0.01", "--sigma", "4", "--steps", "10", "--noise", "bandmf", "--bands", "200"],
        "bands=200",
    ),
    Bad(
        ["--q", "0.01", "--sigma", "4", "--steps", "10", "--noise", "blt", "--sampler", "shuffle"],
        "--sampler",
    ),
    Bad(["--q", "0.01", "--steps", "10", "--noise", "blt"], "--sigma"),
]


def _id(b: Bad) -> str:
    return " ".join(b.args)


@pytest.mark.parametrize("bad", VALIDATION, ids=_id)
def test_train_refuses_in_process(bad, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        (prepare_resume if any(a.startswith("resume=") for a in bad.args) else prepare)(bad.args)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert bad.key in msg, f"error does not name {bad.key!r}: {msg}"
    assert (bad.expect or bad.key) in msg, msg
    assert list(tmp_path.iterdir()) == [], "validation wrote into the working directory"


@pytest.mark.parametrize("bad", PRIVACY_CLI, ids=_id)
def test_privacy_cli_refuses_in_process(bad, capsys):
    with pytest.raises(SystemExit) as e:
        privacy.main(bad.args)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1, err
    assert lines[0].startswith(f"{privacy.PROG}: error: ") and bad.key in lines[0], lines[0]
    assert bad.expect is None or bad.expect in lines[0], lines[0]


def _checked_keys() -> set[str]:
    """Every CHOICES key, and every numeric (int, float, list[int]) or boolean config field."""
    keys = set(CHOICES)
    for prefix, cls in [*GROUPS.items(), ("", Config)]:
        for name, hint in get_type_hints(cls).items():
            types = set(get_args(hint)) | {hint}
            if types & {int, float, bool, list[int]}:
                keys.add(f"{prefix}.{name}" if prefix else name)
    return keys


def _uncovered(table: list[Bad]) -> set[str]:
    return _checked_keys() - {b.key for b in table}


def test_every_checked_key_has_a_refusal_case():
    """The table's coverage: every key with a fixed set of choices and every numeric or boolean
    field of the config dataclasses has a case in ``VALIDATION``."""
    assert {
        "privacy.sigma",
        "privacy.allow_large_delta",
        "model.hidden",
        "training.max_steps",
        "seed",
        "tf32",
        "accountant.name",
    } <= _checked_keys()
    assert not _uncovered(VALIDATION), f"no refusal case for {sorted(_uncovered(VALIDATION))}"
    assert len({_id(b) for b in VALIDATION}) == len(VALIDATION)


# --------------------------------------------------------------------------- real processes
@dataclass
class Case:
    id: str
    cli: str  # "train" | "privacy"
    args: list[str]  # "{run}", "{tmp}" are filled in by the fixture
    key: str  # must appear in the one-line error
    env: dict = field(default_factory=dict)
    line: str | None = None  # the exact stderr line, where given


# A valid, tiny training configuration: each bad case changes one thing.
TINY = [
    "dataset.subset=600",
    "privacy.lot_size=60",
    "privacy.physical_batch_size=60",
    "model.hidden=[8]",
    "model.pca_dims=10",
    "training.epochs=1",
    "training.max_steps=2",
    "training.eval_batch_size=1000",
]
NO_DATA = {
    "DPSGD_DATA_ROOT": "{tmp}/empty_root",
    "DPSGD_DATA_SOURCE": "{tmp}/empty_source",
    # any download attempt fails at once: the proxy is a closed local port
    "http_proxy": "http://127.0.0.1:9",
    "https_proxy": "http://127.0.0.1:9",
    "HTTP_PROXY": "http://127.0.0.1:9",
    "HTTPS_PROXY": "http://127.0.0.1:9",
    "no_proxy": "",
}

PROCESS = [
    # --- end to end: one case of each table above
    Case(
        "e2e_negative_sigma",
        "train",
        ["privacy.sigma=-1"],
        "privacy.sigma",
        line="error: privacy.sigma=-1.0: must be >= 0",
    ),
    Case("e2e_unknown_dataset", "train", ["dataset=imagenet"], "dataset"),
    Case(
        "e2e_privacy_q_above_one", "privacy", ["--q", "1.5", "--sigma", "4", "--epochs", "10"], "q"
    ),
    # --- data: missing, with no network
    Case(
        "missing_data_no_download",
        "train",
        TINY + ["dataset.download=false"],
        "dataset.root",
        env=NO_DATA,
    ),
    Case("missing_data_download_fails", "train", TINY, "dataset.root", env=NO_DATA),
    # --- outputs and resume
    Case("existing_run_dir", "train", TINY + ["hydra.run.dir={tmp}/outputs/old"], "hydra.run.dir"),
    Case("resume_changed_sigma", "train", ["resume={run}", "privacy.sigma=2"], "privacy.sigma"),
]
RESUME = [
    Bad(["resume={run}", "privacy.lot_size=30"], "privacy.lot_size"),
    Bad(["resume={run}", "dataset=fashion_mnist"], "dataset.name"),
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
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")
    }  # e.g. HYDRA_FULL_ERROR
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update({k: _fill(v, subs) for k, v in extra.items()})
    return env


def _cli(cli: str, args: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", f"dpsgd.{cli}", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


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
    ordered = sorted(PROCESS, key=lambda c: any("{run}" in a for a in c.args))
    with ThreadPoolExecutor(max_workers=min(4, (os.cpu_count() or 2) + 1)) as pool:
        run_ready = pool.submit(make_run)
        futures = {c.id: pool.submit(play, c, run_ready) for c in ordered}
        results = {k: f.result() for k, f in futures.items()}
        results["__run__"] = (run_ready.result(), _snapshot(run))
        results["__run_dir__"] = run
    return results


@pytest.mark.parametrize("case", PROCESS, ids=[c.id for c in PROCESS])
def test_refused_before_training(outcomes, case):
    """Each case runs in its own working directory that already holds earlier outputs and must
    exit 2, print exactly one stderr line (``error: <message>``; the privacy CLI prefixes its
    program name, argparse style) naming the key, and leave every pre-existing file byte-identical
    and create nothing. The cases run in a thread pool (``outcomes``)."""
    res, before, after = outcomes[case.id]
    err = res.stderr.strip()
    assert res.returncode == 2, f"exit {res.returncode}; stderr: {err[-1500:]}"
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err[-1500:]}"
    # train: "error: <message>"; privacy (argparse style):
    # "python -m dpsgd.privacy: error: <message>"
    assert lines[0].startswith("error: ") if case.cli == "train" else "error: " in lines[0], lines[
        0
    ]
    assert case.key in lines[0], f"error does not name {case.key!r}: {lines[0]}"
    assert case.line is None or lines[0] == case.line, lines[0]
    assert after == before, "existing outputs changed or new files appeared"


def test_resumed_run_untouched(outcomes):
    before, after = outcomes["__run__"]
    assert after == before, "a refused resume modified the run directory"


@pytest.mark.parametrize("bad", RESUME, ids=_id)
def test_resume_with_changed_privacy_values_refused_in_process(
    outcomes, bad, tmp_path, monkeypatch
):
    run = outcomes["__run_dir__"]
    before = _snapshot(run)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        prepare_resume([_fill(a, {"run": run}) for a in bad.args])
    msg = str(e.value)
    assert "\n" not in msg and bad.key in msg, msg
    assert _snapshot(run) == before and list(tmp_path.iterdir()) == []
