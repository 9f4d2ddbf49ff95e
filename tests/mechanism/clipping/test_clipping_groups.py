"""The clipping-group rule (dpsgd/mechanism/clipping/groups.py) and the table of ghost layer rules
(dpsgd/mechanism/clipping/registry.py).

k, the number of separately clipped groups, enters the privacy claim twice: σ calibration charges
a lot as one Gaussian mechanism at σ/√k (``config.clipping_groups``), and the ledger records the k
of the engine that clips (``len(PerExampleClipper.groups)``). Both come from one function, so they
agree on every model: frozen tensors in no group, a tensor shared by two modules in one group.
"""

import math
import warnings

import pytest
import torch
from torch import nn

from dpsgd.accountant import Ledger
from dpsgd.accountant.events import Poisson
from dpsgd.accountant.calibrate import sigma_for_epsilon
from dpsgd.mechanism.clipping import PerExampleClipper, clipping_groups, register_layer
from dpsgd.mechanism.clipping.groups import owners
from dpsgd.mechanism.clipping.seq_layers import LayerNormLayer, RMSNormLayer
from dpsgd.mechanism.clipping.layers import GenericLayer, LinearLayer, _Layer, group_rows
from dpsgd.mechanism.clipping.registry import LAYER_RULES, registered_rule
from dpsgd.config.calibration import clipping_groups as config_k
from dpsgd.models.networks import MLP, CifarCNN, TanhCNN

from dp_reference import loop_clipped_sum
from tolerances import assert_f64_close

DT = torch.float64
C = 0.05
# float64 sums of at most a few hundred terms: rounding is ~1e-14 relative; a use of a tensor left
# out of its gradient changes it by O(1), so 1e-7 separates the two with room on any CPU.
RTOL = 1e-7


def assert_close(a, b, rtol=RTOL):
    assert a.keys() == b.keys()
    for n in a:
        err = (a[n] - b[n]).norm().item()
        assert err <= rtol * b[n].norm().item() + 1e-14, (n, err)


def frozen_cifar():
    model = CifarCNN(bias=True)
    for n, p in model.named_parameters():
        if n.startswith("features."):
            p.requires_grad_(False)
    return model


DENSE = ["classifier.1", "classifier.3", "classifier.5"]


@pytest.mark.parametrize(
    "make, per_layer",
    [
        (
            lambda: MLP(60, (100,), 10, bias=True),
            [["net.0.weight", "net.0.bias"], ["net.2.weight", "net.2.bias"]],
        ),
        (lambda: MLP(60, (100,), 10, bias=False), [["net.0.weight"], ["net.2.weight"]]),
        (lambda: CifarCNN(bias=True), None),
        (frozen_cifar, None),
        (lambda: TanhCNN(norm="group"), None),
    ],
)
def test_groups_of_the_models(make, per_layer):
    """One group per module owning trainable parameters (global: one group of them all), in module
    order; frozen tensors in none; the engine and the config's k read the same groups."""
    torch.manual_seed(0)
    model = make()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    groups = clipping_groups(model, "per_layer")
    if per_layer is not None:
        assert groups == per_layer
    assert [n for g in groups for n in g] == trainable  # a partition, in parameter order
    assert all(len({n.rsplit(".", 1)[0] for n in g}) == 1 for g in groups)  # one module each
    assert clipping_groups(model, "global") == [trainable]
    for clipping in ("global", "per_layer"):
        engine = PerExampleClipper(model, C, clipping)
        assert engine.groups == clipping_groups(model, clipping)
        assert config_k(model, clipping) == len(engine.groups)


def test_per_layer_and_global_k():
    """k: 1 under global clipping; under per_layer, the trained modules (CIFAR net: 2 convs and 3
    dense layers; with the convolutions frozen, the 3 dense layers; the tanh CNN with GroupNorm:
    4 layers and 2 GroupNorms)."""
    for model, k in (
        (MLP(60, (1000,), 10), 2),
        (CifarCNN(), 5),
        (frozen_cifar(), 3),
        (TanhCNN(norm="none"), 4),
        (TanhCNN(norm="group"), 6),
    ):
        assert len(clipping_groups(model, "global")) == 1 == config_k(model, "global")
        assert len(clipping_groups(model, "per_layer")) == k == config_k(model, "per_layer")
    assert clipping_groups(frozen_cifar(), "per_layer") == [
        [f"{m}.weight", f"{m}.bias"] for m in DENSE
    ]


def test_config_k_applies_model_freeze():
    """σ calibration builds the model on the meta device without its public weights:
    ``model.freeze`` is applied there too, so the calibrated k is the k the engine clips (and the
    ledger records)."""
    with torch.device("meta"):
        model = CifarCNN(bias=True)
    assert (
        config_k(model, "per_layer", "features")
        == 3
        == len(PerExampleClipper(frozen_cifar(), C, "per_layer").groups)
    )


def test_no_trainable_parameters_and_bad_clipping_refused():
    model = MLP(4, (3,), 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        clipping_groups(model, "per_layer")
    with pytest.raises(ValueError, match="clipping"):
        clipping_groups(MLP(4, (3,), 2), "layer")


class TiedLayers(nn.Module):
    """``b`` reuses ``a``'s weight (the same nn.Parameter registered in both modules) and has no
    bias of its own: the tensor is trained through two uses, and ``b`` owns nothing new."""

    def __init__(self, bias_b=False):
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, 5, bias=bias_b)
        self.b.weight = self.a.weight
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


def tied_data(n=7):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 5, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)


def test_shared_parameter_is_one_tensor_in_its_first_owners_group():
    model = TiedLayers()
    assert [n for n, _ in model.named_parameters()] == [
        "a.weight",
        "a.bias",
        "head.weight",
        "head.bias",
    ]
    assert clipping_groups(model, "per_layer") == [
        ["a.weight", "a.bias"],
        ["head.weight", "head.bias"],
    ]
    assert clipping_groups(model, "global") == [["a.weight", "a.bias", "head.weight", "head.bias"]]
    o = owners(model)
    assert [(x.name, x.params, x.aliases) for x in o] == [
        ("a", {"weight": "a.weight", "bias": "a.bias"}, {}),
        ("b", {}, {"weight": "a.weight"}),
        ("head", {"weight": "head.weight", "bias": "head.bias"}, {}),
    ]
    model = TiedLayers(bias_b=True)  # b owns its bias: a group of that alone
    assert clipping_groups(model, "per_layer") == [
        ["a.weight", "a.bias"],
        ["b.bias"],
        ["head.weight", "head.bias"],
    ]


@pytest.mark.parametrize("clipping", ["global", "per_layer"])
def test_shared_parameter_engine_config_and_ledger_agree(clipping):
    """Engine, the config's k (σ calibration) and the ledger's k agree on a tied model, and the
    engine clips the gradient of the shared tensor summed over both uses (the batch-of-1 loop)."""
    torch.manual_seed(0)
    model = TiedLayers().to(DT)
    x, y = tied_data()
    vmap = PerExampleClipper(model, C, clipping, mode="vmap")
    auto = PerExampleClipper(model, C, clipping, mode="auto")
    assert vmap.groups == auto.groups == clipping_groups(model, clipping)
    k = len(vmap.groups)
    assert k == (1 if clipping == "global" else 2) == config_k(model, clipping)
    # the ghost engine does not form the cross term of the two uses: auto runs vmap
    assert auto.mode == "vmap"
    ref, ref_norms = loop_clipped_sum(model, x, y, vmap.groups, C)
    for clipper in (vmap, auto):
        res = clipper.clipped_sum(x, y)
        assert_close(res.grads, ref)
        assert_f64_close(
            res.norms, ref_norms, RTOL
        )  # norms that are 0 exactly: an absolute floor at RTOL·max
    # σ calibrated with the config's k spends the target ε when the ledger charges the engine's k
    q, steps, delta, target = 0.01, 1000, 1e-5, 2.0
    sigma = sigma_for_epsilon(target, delta, q, steps, "rdp", config_k(model, clipping), "joint")
    led = Ledger()
    led.record(Poisson(q, sigma, len(auto.groups)), steps)
    eps = led.epsilon(delta, accountant="rdp", convention="joint")[0]
    assert (1 - 0.005) * target <= eps <= target  # calibrate.sigma_for_epsilon's rtol = 0.5 %


def test_ghost_refuses_a_shared_parameter():
    model = TiedLayers().to(DT)
    with pytest.raises(ValueError, match="'b.weight' is shared with 'a.weight'"):
        PerExampleClipper(model, C, "per_layer", mode="ghost")


def test_frozen_shared_parameter_is_in_no_group_and_ghost_handles_the_rest():
    torch.manual_seed(0)
    model = TiedLayers().to(DT)
    model.a.weight.requires_grad_(False)
    assert clipping_groups(model, "per_layer") == [["a.bias"], ["head.weight", "head.bias"]]
    ghost = PerExampleClipper(model, C, "per_layer", mode="ghost")
    x, y = tied_data()
    ref, ref_norms = loop_clipped_sum(model, x, y, ghost.groups, C)
    res = ghost.clipped_sum(x, y)
    assert ghost.mode == "ghost"
    assert_close(res.grads, ref)
    assert_f64_close(
        res.norms, ref_norms, RTOL
    )  # norms that are 0 exactly: an absolute floor at RTOL·max


# -- the registry ------------------------------------------------------------------------------
class Scale(nn.Module):
    """y = x ⊙ w on [B, d] input: per-example weight gradient a_i ⊙ b_i."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return x * self.weight


class ScaleChild(Scale):
    """Keeps Scale's forward: Scale's rule applies (found through the MRO)."""


class ScaleOverride(Scale):
    """Overrides forward: Scale's rule may not apply."""

    def forward(self, x):
        return x * self.weight.square()


class ScaleLayer(_Layer):
    calls = 0

    def sq_norms(self, a, b, keep, K=1):
        type(self).calls += 1
        G = group_rows(a * b, K)  # [B, d] per-example gradients of the weight
        return {"weight": torch.linalg.vector_norm(G, dim=1).square()}, G

    def clipped_sum(self, a, b, state, factors, own_b=False, out=None, K=1):
        g = state.t() @ factors["weight"]
        return {"weight": g if out is None or "weight" not in out else out["weight"].add_(g)}


@pytest.fixture
def scale_rule():
    register_layer(Scale)(ScaleLayer)
    ScaleLayer.calls = 0
    yield ScaleLayer
    del LAYER_RULES[Scale]


def scale_net(cls=Scale):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 4), nn.Tanh(), cls(4), nn.Linear(4, 3)).to(DT)


def test_builtin_rules_are_registered():
    assert registered_rule(nn.Linear(2, 2)) is LinearLayer
    assert registered_rule(nn.LayerNorm(2)) is LayerNormLayer
    assert registered_rule(nn.RMSNorm(2)) is RMSNormLayer
    assert registered_rule(nn.PReLU()) is None
    assert registered_rule(Scale(2)) is None


@pytest.mark.parametrize("clipping", ["global", "per_layer"])
def test_a_registered_rule_is_used(scale_rule, clipping):
    model = scale_net()
    x, y = torch.randn(8, 6, dtype=DT), torch.randint(0, 3, (8,))
    ghost = PerExampleClipper(model, C, clipping, mode="ghost")
    assert [type(l) for l in ghost._layers] == [
        LinearLayer,
        ScaleLayer,
        LinearLayer,
    ] and ghost.native
    ref, ref_norms = loop_clipped_sum(model, x, y, ghost.groups, C)
    for _ in range(2):  # first call proves the structure (proof.py)
        res = ghost.clipped_sum(x, y)
        assert_close(res.grads, ref)
        assert_f64_close(
            res.norms, ref_norms, RTOL
        )  # norms that are 0 exactly: an absolute floor at RTOL·max
    assert ScaleLayer.calls == 3  # two calls, and the first one's proof on the float64 twin


def test_rule_lookup_by_type_then_mro(scale_rule):
    assert registered_rule(Scale(3)) is ScaleLayer
    assert registered_rule(ScaleChild(3)) is ScaleLayer  # base class's rule, same forward
    assert registered_rule(ScaleOverride(3)) is None  # its own forward: no rule
    ghost = PerExampleClipper(scale_net(ScaleOverride), C, "per_layer", mode="ghost")
    assert type(ghost._layers[1]) is GenericLayer and not ghost.native  # leaf: per-module vmap


def test_without_a_rule_a_leaf_runs_per_module_vmap():
    ghost = PerExampleClipper(scale_net(), C, "per_layer", mode="ghost")
    assert type(ghost._layers[1]) is GenericLayer and not ghost.native


class Gate(nn.Module):
    """Owns a parameter and has a submodule: without a rule, its forward may use it in any way."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.ones(4))
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x * self.gate)


def test_an_unknown_module_type_is_refused_clearly():
    model = nn.Sequential(nn.Linear(6, 4), Gate()).to(DT)
    with pytest.raises(
        ValueError,
        match=r"'1' \(Gate\) owns parameters and has submodules.*"
        r"no layer rule is registered for Gate.*register_layer",
    ):
        PerExampleClipper(model, C, "per_layer", mode="ghost")
    auto = PerExampleClipper(model, C, "per_layer", mode="auto")
    x, y = torch.randn(5, 6, dtype=DT), torch.randint(0, 3, (5,))
    with pytest.warns(UserWarning, match=r"^ghost clipping cannot run this model: .*'1' \(Gate\)"):
        auto.clipped_sum(x, y)  # said once, with the exact engine its first call proves
    assert auto.mode == "vmap" and len(auto.groups) == 3  # the groups do not depend on the engine


def test_register_layer_takes_module_types():
    with pytest.raises(TypeError, match="nn.Module"):
        register_layer(int)
    with pytest.raises(TypeError, match="at least one"):
        register_layer()


def test_audit_claim_charges_sigma_over_root_k_through_compose():
    """The audit's exact claim (q = 1) uses the joint convention's σ/√k of compose.charge.
    Compared exactly: the same expression and the same call on the same inputs, one process."""
    from dpsgd.accountant import compose
    from dpsgd.audit.game.claim import claimed_epsilon
    from dpsgd.audit.game.settings import AuditConfig
    from dpsgd.accountant.strong_composition import gaussian_epsilon

    cfg = AuditConfig(q=1.0, sigma=2.0, delta=1e-5, accountants=())
    for k in (1, 3):
        _, s_eff, n = compose.charge(1.0, 2.0, k, "joint")
        assert n == 1 and s_eff == 2.0 / math.sqrt(k)
        assert claimed_epsilon(cfg, k)["exact"] == gaussian_epsilon(1e-5, s_eff, "analytic")
