"""Config validation: bad values are refused before any work, one line naming the key."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpsgd.config import Config, ConfigError, validate
from dpsgd.launch import compose, prepare

REPO = Path(__file__).resolve().parent.parent


def test_defaults_and_presets_validate():
    c = validate(compose([]))
    assert isinstance(c, Config) and c.privacy.convention == "joint" and c.N == 60000
    for name, sigma, sigma_p, eps in [("small", 2, 4, 8), ("medium", 4, 7, 2), ("large", 8, 16, 0.5)]:
        c = validate(compose([f"experiment=mnist_{name}"]))
        p = c.privacy
        assert (p.sigma, p.sigma_p, p.target_epsilon) == (sigma, sigma_p, eps)
        assert (p.clip_norm, p.lot_size, p.delta, p.clipping, p.convention) == (4, 600, 1e-5, "per_layer", "per_tensor")
        assert (c.model.pca_dims, c.model.hidden, c.model.bias) == (60, [1000], False)
        assert c.name == f"mnist_{name}"
    c = validate(compose(["experiment=mnist_nonprivate"]))
    assert not c.privacy.private and c.privacy.target_epsilon is None


BAD = [
    (["privacy.sigma=-1"], "privacy.sigma=-1.0: must be >= 0"),
    (["privacy.target_epsilon=0.5"], "privacy.target_epsilon=0.5: the DP-PCA release alone costs"),
    (["model.init=xavier"], "model.init"),
    (["privacy.sigma_p=-0.5"], "privacy.sigma_p"),
    (["privacy.sigma=0"], "privacy.sigma=0.0: a private run needs noise"),
    (["privacy.sigma_p=0"], "privacy.sigma_p=0.0"),
    (["privacy.clip_norm=0"], "privacy.clip_norm"),
    (["privacy.clip_norm=-4"], "privacy.clip_norm"),
    (["privacy.lot_size=60001"], "privacy.lot_size=60001: must be <= N=60000"),
    (["dataset.subset=1000", "privacy.lot_size=1001"], "privacy.lot_size=1001"),
    (["privacy.lot_size=0"], "privacy.lot_size"),
    (["privacy.delta=0"], "privacy.delta"),
    (["privacy.delta=1"], "privacy.delta"),
    (["privacy.target_epsilon=0"], "privacy.target_epsilon"),
    (["privacy.target_epsilon=-2"], "privacy.target_epsilon"),
    (["privacy.clipping=perlayer"], "privacy.clipping=perlayer: unknown"),
    (["privacy.convention=paper"], "privacy.convention"),
    (["privacy.sampling=uniform"], "privacy.sampling"),
    (["privacy.grad_sample_mode=jax"], "privacy.grad_sample_mode"),
    (["privacy.physical_batch_size=0"], "privacy.physical_batch_size"),
    (["privacy.secure_rng=true", "privacy.noise_seed=3"], "privacy.noise_seed"),
    (["privacy.pca_fraction=1.5"], "privacy.pca_fraction"),
    (["accountant.name=gdp"], "accountant.name"),
    (["training.lr=nan"], "training.lr=nan"),
    (["training.lr=inf"], "training.lr"),
    (["training.lr=0"], "training.lr"),
    (["training.epochs=2.5"], "training.epochs=2.5: must be an integer"),
    (["training.epochs=-1"], "training.epochs"),
    (["training.epochs=ten"], "training.epochs"),
    (["model.pca_dims=785"], "model.pca_dims=785"),
    (["model.hidden=[1000,0]"], "model.hidden[1]"),
    (["model.projection=svd"], "model.projection"),
    (["model=cnn"], "model.name=cnn"),
    (["dataset.subset=0"], "dataset.subset"),
    (["seed=-1"], "seed"),
    (["device=tpu"], "device"),
    (["tf32=sometimes"], "tf32"),
    (["resume=/nonexistent/run"], "resume=/nonexistent/run: no such run directory"),
]


@pytest.mark.parametrize("overrides,expected", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_values_refused_naming_the_key(overrides, expected):
    with pytest.raises(ConfigError) as e:
        validate(compose(overrides))
    msg = str(e.value)
    assert expected in msg and "\n" not in msg


def test_unknown_group_option_and_key_refused_on_one_line():
    for args, key in [(["dataset=svhn"], "dataset/svhn"), (["privacy.sigmaa=1"], "privacy.sigmaa")]:
        with pytest.raises(ConfigError) as e:
            prepare(args)
        assert key in str(e.value) and "\n" not in str(e.value)


def test_batchnorm_models_are_refused(monkeypatch):
    import torch.nn as nn

    import dpsgd.config as cfgmod
    monkeypatch.setattr(cfgmod, "build_model",
                        lambda m, shape, classes: nn.Sequential(nn.Linear(60, 10), nn.BatchNorm1d(10)))
    with pytest.raises(ConfigError, match="model.name=mlp: .*BatchNorm"):
        validate(compose([]))


def _cli(args, cwd):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "dpsgd.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_refusal_exit_2_one_line_no_files(tmp_path):
    r = _cli(["privacy.sigma=-1"], tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: privacy.sigma=-1.0: must be >= 0"]
    assert list(tmp_path.iterdir()) == []                       # no Hydra output folder


def test_cli_refuses_existing_run_dir_and_leaves_it_untouched(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_text("epoch\n1\n")
    before = (run / "metrics.csv").stat().st_mtime_ns
    r = _cli([f"hydra.run.dir={run}", "dataset.subset=1000", "privacy.lot_size=100"], tmp_path)
    assert r.returncode == 2 and "hydra.run.dir=" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in run.iterdir()) == ["metrics.csv"]
    assert (run / "metrics.csv").stat().st_mtime_ns == before
