"""The null-space placement of gradient canaries (dpsgd/audit/onerun/placement.py,
docs/AUDIT_MATH.md §6): the class-sum directions of the softmax output layer get exactly zero
gradient from every real example, moving along them leaves the model's outputs unchanged, a canary
lands only on its own direction, and a tiny audit's excluded canaries spread as the claimed channel
predicts."""

import json
import math
from dataclasses import asdict

import numpy as np
import pytest
import torch
from torch import nn

from dpsgd.audit.onerun.canaries import GradientCanaries
from dpsgd.audit.onerun.instrument import AuditOptions
from dpsgd.audit.onerun.placement import class_sum_directions, output_layer, place
from dpsgd.audit.onerun.run import ENV, audit_train, split_args
from dpsgd.config.schema import validate
from dpsgd.core.errors import ConfigError
from dpsgd.launch.main import compose
from dpsgd.mechanism.clipping import PerExampleClipper
from dpsgd.models.networks import MLP

K, H, D, B = 5, 12, 6, 32


def _model(bias=True):
    torch.manual_seed(0)
    return MLP(D, (H,), K, bias=bias).double()


def _unit_directions(model):
    """[n_dirs, P] every class-sum direction of the output layer as a unit vector over all
    parameters."""
    names = [n for n, _ in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]
    offset = dict(zip(names, [sum(sizes[:i]) for i in range(len(sizes))]))
    dirs = []
    for n, idx in class_sum_directions(
        *output_layer(model, K, torch.randn(3, D, dtype=torch.float64))
    ).items():
        for row in idx:
            u = torch.zeros(sum(sizes), dtype=torch.float64)
            u[offset[n] + row] = 1 / math.sqrt(len(row))
            dirs.append(u)
    return torch.stack(dirs)


@pytest.mark.parametrize("clipping", ["per_layer", "global"])
def test_real_gradients_are_zero_along_the_class_sum_directions(clipping):
    model = _model()
    U = _unit_directions(model)
    assert len(U) == H + 1  # one per column of W, one for the bias
    clipper = PerExampleClipper(model, 1.0, clipping)
    x, y = torch.randn(B, D, dtype=torch.float64) * 3, torch.randint(0, K, (B,))
    g = clipper.clipped_sum(x, y).grads
    flat = torch.cat([g[n].reshape(-1) for n, _ in model.named_parameters()])
    assert flat.norm() > 0.1  # the examples do move the model elsewhere
    # Σ_k (p_k − y_k) = 0 exactly; in float64 each of B examples leaves at most a few ulps
    # (|h_j| ≤ 1e2)
    assert (U @ flat).abs().max() < B * 1e2 * 1e-14
    # moving θ along every u changes no softmax output
    with torch.no_grad():
        before = torch.softmax(model(x), 1)
        theta = torch.nn.utils.parameters_to_vector(model.parameters())
        torch.nn.utils.vector_to_parameters(theta + 3.0 * U.sum(0), model.parameters())
        after = torch.softmax(model(x), 1)
    # (softmax ignores a constant added to every logit)
    # exact in exact arithmetic; float64 round-off only
    assert torch.allclose(before, after, rtol=0, atol=1e-12)


def test_a_canary_lands_only_on_its_own_direction():
    model = _model()
    clipper = PerExampleClipper(model, 1.5, "per_layer")
    placed = place(
        clipper,
        4,
        seed=0,
        placement="null_space",
        classes=K,
        probe=torch.randn(3, D, dtype=torch.float64),
    )
    assert (placed["groups_used"], placed["null_groups"], placed["dirac_groups"]) == (1, 1, 0)
    wrapped = GradientCanaries(
        clipper, placed["coords"], torch.tensor([True, True, False, True]), a=15.0
    )
    y = torch.tensor([-1, -3, -4])  # canaries 0, 2 (out: zero gradient), 3
    g = wrapped.clipped_sum(torch.zeros(3, D, dtype=torch.float64), y).grads
    want = {n: torch.zeros_like(p).reshape(-1) for n, p in model.named_parameters()}
    for i in (0, 3):
        for n, idx in placed["coords"].items():
            if idx.dim() == 2 and idx[i, 0] >= 0:
                want[n][idx[i]] += 1.5 / math.sqrt(
                    K
                )  # a = 15 clipped to C = 1.5, spread over K entries
    for n in want:  # exact up to float64 round-off: the same product C/√K written into each entry
        assert torch.allclose(g[n].reshape(-1), want[n], rtol=0, atol=1e-12), n


def test_loose_group_loosens_the_first_group_that_carries_canaries():
    """``loose_group`` clips at 2C the first group holding canaries: the output layer's under the
    null-space placement (group 1 here), group 0 under the Dirac one; a looser group without
    canaries is unseeable."""
    model = _model(bias=False)
    clipper = PerExampleClipper(model, 1.5, "per_layer")
    for placement, group in (("null_space", 1), ("dirac", 0)):
        placed = place(
            clipper,
            4,
            seed=0,
            placement=placement,
            classes=K,
            probe=torch.randn(3, D, dtype=torch.float64),
        )
        loose = GradientCanaries(
            clipper, placed["coords"], torch.ones(4, dtype=torch.bool), a=15.0, loose=2.0
        )
        assert loose.loose_group == group
        # a = 15 clipped to 2C = 3 in that group, to C = 1.5 elsewhere (exact: min(a, bound) in
        # float64)
        want = [1.5] * len(clipper.groups)
        want[group] = 3.0
        assert loose._values("cpu", torch.float64).tolist() == want


def test_refusals_name_the_option():
    probe = torch.randn(3, D)
    with pytest.raises(
        ConfigError, match="audit.placement=null_space"
    ):  # a layer after the logits mixes them
        output_layer(nn.Sequential(nn.Linear(D, K), nn.Tanh()), K, probe)
    clipper = PerExampleClipper(MLP(D, (H,), K, bias=False), 1.0, "per_layer")
    with pytest.raises(
        ConfigError, match="audit.gradient_canaries=13"
    ):  # H = 12 directions without a bias
        place(clipper, 13, 0, "null_space", K, probe)
    for bad in ("audit.placement=nowhere", "audit.normalise=robust"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            split_args([bad])


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


def test_tiny_audit_has_no_interference_and_proves_independence(tmp_path, monkeypatch):
    o = AuditOptions(
        gradient_canaries=200, input_canaries=0, placement="null_space", normalise="claimed"
    ).validate()
    monkeypatch.setenv(ENV, json.dumps(asdict(o)))
    audit_train(validate(compose(TINY)), tmp_path / "a", TINY)
    a = json.loads((tmp_path / "a" / "audit.json").read_text())
    assert (
        a["run"]["canary_placement"]["null_space_groups"] == 1
        and a["run"]["canary_groups_used"] == 1
    )
    fam = a["family"]
    assert (
        fam["order_stats"]["independence"] == "proved" and "proved" in fam["order_stats"]["label"]
    )
    assert (
        "independent canaries: proved (null-space placement, claimed normalisation)"
        in fam["order_stats"]["assumes"]
    )
    assert fam["interference"]["channel_groups"] == 1
    n = a["games"][0]["m"] - a["games"][0]["included"]
    # the excluded scores are sums of 24 i.i.d. near-Gaussian lot terms: their sample variance / the
    # claim's is within 5 standard errors (√(2/(n − 1))) of 1 when nothing else reaches the canaries
    assert abs(fam["interference"]["out_var_ratio"] - 1) < 5 * math.sqrt(2 / (n - 1))
    assert a["verdict_family"] == "consistent"
    ch = fam["channel"]  # k_used = 1 of k = 2 groups: the canaries' own channel, tested too
    assert (
        ch["groups"] == 1
        and ch["eps_channel"] < fam["eps_claimed_lots"]
        and ch["order_stats_counts"]
    )
    assert ch["verdict_channel"] == "consistent"
    nt = a["noise_test"]  # the excluded canaries see the claimed noise
    assert nt["exact"] and nt["n"] == n * a["run"]["steps"]
    assert abs(nt["noise_ratio"] - 1) < 5 * math.sqrt(
        1 / (2 * nt["n"])
    )  # 5 standard errors of √(χ²_n / n)


def test_noise_test_is_the_chi_square_law():
    """Q = Σ z² over n i.i.d. N(0, s²) is s²·χ²_n: at s = 1 the p-value is uniform (rejections ≈ β
    over many draws), at s = 1/2 (noise σC/2) it rejects every time."""
    from scipy import stats
    from dpsgd.audit.onerun.stats.noise_check import noise_test

    rng = np.random.default_rng(0)
    bits = np.zeros(200, dtype=bool)
    rejects = sum(
        noise_test((rng.normal(size=(200, 10)) ** 2).sum(1), bits, 10, 0.05, True)["verdict"]
        == "violation"
        for _ in range(2000)
    )
    assert (
        stats.binom.cdf(rejects, 2000, 0.05) > 1e-6
        and stats.binom.sf(rejects - 1, 2000, 0.05) > 1e-6
    )
    half = noise_test(((0.5 * rng.normal(size=(200, 10))) ** 2).sum(1), bits, 10, 0.05, True)
    assert half["verdict"] == "violation" and half["noise_ratio_upper"] < 0.6


def test_a_model_without_a_softmax_output_layer_falls_back_to_dirac_labelled(
    tmp_path, monkeypatch, capsys
):
    # a user's network whose logits pass through a layer after the last Linear: no class-sum
    # null space; the audit says so in one line, places the canaries by Dirac, labels it in
    # audit.json, and claims no proved independence
    (tmp_path / "tanh_nets.py").write_text(
        "from torch import nn\n"
        "class TanhHead(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(),\n"
        "                                 nn.Linear(32, 10), nn.Tanh())\n"
        "    def forward(self, x):\n"
        "        return self.net(x)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["model=custom", "model._target_=tanh_nets.TanhHead", "dataset.subset=300",
            "privacy.lot_size=100", "training.epochs=1", "device=cpu", "privacy.sigma=3",
            "privacy.clipping=global"]  # fmt: skip
    o = AuditOptions(
        gradient_canaries=200, input_canaries=0, placement="null_space", normalise="claimed"
    ).validate()
    monkeypatch.setenv(ENV, json.dumps(asdict(o)))
    audit_train(validate(compose(args)), tmp_path / "a", args)
    a = json.loads((tmp_path / "a" / "audit.json").read_text())
    placed = a["run"]["canary_placement"]
    assert placed["placement"] == "dirac" and placed["fallback_from"] == "null_space"
    assert "no softmax output layer" in placed["fallback_reason"]
    assert a["family"]["order_stats"]["independence"] != "proved"
    out = capsys.readouterr().out
    assert (
        "audit.placement=null_space does not apply (this model has no softmax output layer" in out
    )
