"""Config validation: presets and sweeps pass, the bounds sit where they are documented.

The table of refused values (one line naming the key) is tests/launch/test_prepare.py.
"""

import itertools
from pathlib import Path

import pytest
import yaml

from dpsgd.accountant import limits as acc_limits
from dpsgd.config.schema import Config, ConfigError, validate
from dpsgd.launch.main import compose
from dpsgd.config.model import PARAMS_MAX

REPO = Path(__file__).resolve().parents[2]


def test_defaults_and_presets_validate():
    c = validate(compose([]))
    assert isinstance(c, Config) and c.privacy.convention == "joint" and c.N == 60000
    for name, sigma, sigma_p, eps in [
        ("small", 2, 4, 8),
        ("medium", 4, 7, 2),
        ("large", 8, 16, 0.5),
    ]:
        c = validate(compose([f"experiment=mnist_{name}"]))
        p = c.privacy
        assert (p.sigma, p.sigma_p, p.target_epsilon) == (sigma, sigma_p, eps)
        assert (p.clip_norm, p.lot_size, p.delta, p.clipping, p.convention) == (
            4,
            600,
            1e-5,
            "per_layer",
            "per_tensor",
        )
        assert (c.model.pca_dims, c.model.hidden, c.model.bias) == (60, [1000], False)
        assert c.name == f"mnist_{name}"
    c = validate(compose(["experiment=mnist_nonprivate"]))
    assert not c.privacy.private and c.privacy.target_epsilon is None


def test_batchnorm_models_are_refused(monkeypatch):
    import torch.nn as nn

    import dpsgd.config.model as cfgmod

    monkeypatch.setattr(
        cfgmod,
        "build_model",
        lambda m, shape, classes: nn.Sequential(nn.Linear(60, 10), nn.BatchNorm1d(10)),
    )
    with pytest.raises(ConfigError, match="model.name=mlp: .*BatchNorm"):
        validate(compose([]))


def _sweep_runs(name: str) -> list[list[str]]:
    """The overrides of every job of ``-m +sweep=<name>``, expanded by Hydra's own override
    parser."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = yaml.safe_load((REPO / "conf" / "sweep" / f"{name}.yaml").read_text())["hydra"][
        "sweeper"
    ]["params"]
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    axes = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] for o in parsed]
    return [[f"+sweep={name}", *job] for job in itertools.product(*axes)]


SWEEPS = sorted(f.stem for f in (REPO / "conf" / "sweep").glob("*.yaml"))


@pytest.mark.parametrize("name", SWEEPS)
def test_every_sweep_job_validates(name):
    jobs = _sweep_runs(name)
    assert len(jobs) >= 3
    for job in jobs:
        c = validate(compose(job))
        assert c.privacy.delta == 1e-5 and c.N == 60000 and not c.privacy.allow_large_delta


def test_large_delta_only_when_demanded_and_recorded():
    # δ < 1/N is required in a private run; N is the number of training examples used (the subset)
    sub = ["dataset.subset=1000"]  # 1/N = 1e-3
    assert validate(compose(sub + ["privacy.delta=0.000999"])).privacy.delta == 0.000999
    for delta in ("0.001", "0.5"):  # δ = 1/N is refused too
        with pytest.raises(
            ConfigError, match=rf"^privacy\.delta={delta}: must be < 1/N = 0\.001 \(N=1000 "
        ):
            validate(compose(sub + [f"privacy.delta={delta}"]))
    c = validate(compose(sub + ["privacy.delta=0.5", "privacy.allow_large_delta=true"]))
    assert c.privacy.delta == 0.5 and c.privacy.allow_large_delta is True
    resolved = yaml.safe_load(
        yaml.safe_dump(c.to_dict(), sort_keys=False)
    )  # as config.resolved.yaml
    assert resolved["privacy"]["allow_large_delta"] is True and resolved["privacy"]["delta"] == 0.5
    # a non-private run states no (ε, δ): nothing to refuse
    assert (
        validate(compose(["experiment=mnist_nonprivate", "privacy.delta=0.5"])).privacy.delta == 0.5
    )


def test_accountant_ranges_are_inclusive_and_private_only():
    lo, hi = acc_limits.SIGMA_MIN, acc_limits.SIGMA_MAX
    for key in ("privacy.sigma", "privacy.sigma_p"):
        for v in (lo, hi):
            assert getattr(validate(compose([f"{key}={v!r}"])).privacy, key.split(".")[1]) == v
        for v in (lo * (1 - 1e-9), hi * (1 + 1e-9)):
            with pytest.raises(ConfigError, match=rf"^{key}=.*: must be in \[0\.01, 1e\+06\]"):
                validate(compose([f"{key}={v!r}"]))
    # shuffle sampling charges σ/2 per epoch (substitution adjacency): the charge must be served
    assert (
        validate(compose(["privacy.sampling=shuffle", "privacy.sigma=0.02"])).privacy.sigma == 0.02
    )
    with pytest.raises(
        ConfigError, match=r"^privacy\.sigma=0\.015 \(charged as 0\.0075\): must be in \[0\.01,"
    ):
        validate(compose(["privacy.sampling=shuffle", "privacy.sigma=0.015"]))
    # σ_p is not used without DP-PCA, σ not without privacy: only σ >= 0 is asked
    assert (
        validate(compose(["model.projection=random", "privacy.sigma_p=1e-300"])).privacy.sigma_p
        == 1e-300
    )
    assert (
        validate(compose(["experiment=mnist_nonprivate", "privacy.sigma=1e308"])).privacy.sigma
        == 1e308
    )
    eps = acc_limits.EPSILON_MAX
    assert validate(compose([f"privacy.target_epsilon={eps!r}"])).privacy.target_epsilon == eps
    with pytest.raises(ConfigError, match=r"^privacy\.delta=1e-101: must be >= 1e-100$"):
        validate(compose(["privacy.delta=1e-101"]))
    assert (
        validate(compose([f"privacy.delta={acc_limits.DELTA_MIN!r}"])).privacy.delta
        == acc_limits.DELTA_MIN
    )


def test_lots_bound_counts_the_sampler_lots():
    # Poisson: round(N/L) lots per epoch; L = 1, N = 60000: 60000 lots an epoch, STEPS_MAX = 10**9
    assert acc_limits.STEPS_MAX == 10**9
    ok = validate(compose(["privacy.lot_size=1", "training.epochs=16666"]))  # 999 960 000 lots
    assert ok.training.epochs == 16666
    with pytest.raises(ConfigError, match=r"^training\.epochs=16667: 1000020000 lots \(poisson"):
        validate(compose(["privacy.lot_size=1", "training.epochs=16667"]))
    # shuffle: floor(N/L) lots; L = 7: 8571 lots an epoch, 116 673 epochs = 1 000 004 283 lots
    with pytest.raises(ConfigError, match=r"^training\.epochs=116673: 1000004283 lots \(shuffle"):
        validate(
            compose(["privacy.sampling=shuffle", "privacy.lot_size=7", "training.epochs=116673"])
        )
    assert (
        validate(
            compose(["privacy.sampling=shuffle", "privacy.lot_size=7", "training.epochs=116672"])
        ).training.epochs
        == 116672
    )
    assert validate(compose(["training.max_steps=1000000000"])).training.max_steps == 10**9


def test_q_below_the_accountants_range_is_refused(monkeypatch):
    # No dataset is large enough for q = 1/N < Q_MIN = 1e-9; a raised Q_MIN shows the check is
    # wired.
    args = ["dataset.subset=600", "privacy.lot_size=60"]  # q = 0.1
    assert validate(compose(args)).privacy.lot_size == 60
    monkeypatch.setattr(acc_limits, "Q_MIN", 0.2)
    with pytest.raises(
        ConfigError, match=r"^privacy\.lot_size=60: q = L/N = 0\.1 \(N=600\) is below Q_MIN=0\.2"
    ):
        validate(compose(args))


def test_model_size_bounds():
    # MLP on 60 PCA dims, no bias: 60 h + 10 h = 70 h parameters; PARAMS_MAX = 10**9
    assert PARAMS_MAX == 10**9
    assert validate(compose(["model.hidden=[14285714]"])).model.hidden == [14285714]  # 999 999 980
    with pytest.raises(
        ConfigError, match=r"^model\.hidden=\[14285715\]: 1000000050 parameters \(mlp\)"
    ):
        validate(compose(["model.hidden=[14285715]"]))  # 1 000 000 050
    # per-layer clipping: one group per layer, at most GROUPS_MAX; refused before any model is built
    n = acc_limits.GROUPS_MAX
    with pytest.raises(ConfigError, match=rf"^model\.hidden: {n} hidden layers; .*GROUPS_MAX={n}"):
        validate({"model": {"hidden": [1] * acc_limits.GROUPS_MAX}})


def test_batch_bounds_are_the_largest_batch_ever_formed():
    # physical batch <= N (a lot never holds more); evaluation batch <= max(N, test examples)
    sub = ["dataset.subset=600", "privacy.lot_size=60"]
    assert (
        validate(compose(sub + ["privacy.physical_batch_size=600"])).privacy.physical_batch_size
        == 600
    )
    with pytest.raises(ConfigError, match=r"^privacy\.physical_batch_size=601: must be <= 600$"):
        validate(compose(sub + ["privacy.physical_batch_size=601"]))
    assert (
        validate(compose(sub + ["training.eval_batch_size=10000"])).training.eval_batch_size
        == 10000
    )
    # larger than every evaluated set: that set whole, the same batches
    assert validate(compose(sub + ["training.eval_batch_size=10001"])).training.eval_batch_size == (
        10000
    )
    with pytest.raises(ConfigError, match=r"^training\.eval_batch_size=0: must be >= 1$"):
        validate(compose(sub + ["training.eval_batch_size=0"]))


def test_cifar_data_are_named_before_the_pretrained_artifact(tmp_path, monkeypatch):
    """No CIFAR here and no artifact: the data come first (the artifact is built from them)."""
    monkeypatch.setenv("DPSGD_DATA_SOURCE", str(tmp_path / "nothing"))
    args = ["experiment=cifar10_eps2", f"dataset.root={tmp_path}", "model.pretrained=none.pt"]
    with pytest.raises(ConfigError, match=r"^dataset=cifar10: cifar10, cifar100 not in the data "):
        validate(compose(args))
