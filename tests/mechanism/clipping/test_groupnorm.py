"""GroupNorm in the clipping engines: the ghost rule
(dpsgd/mechanism/clipping/layers.py:GroupNormLayer) equals the vmap reference and a batch-of-1
autograd loop, in float64, for every clipping and memory budget; frozen GroupNorm parameters;
BatchNorm stays refused."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dp_reference import assert_close, loop_clipped_sum
from dpsgd.mechanism.clipping import PerExampleClipper
from dpsgd.mechanism.clipping.layers import GenericLayer, GroupNormLayer
from tolerances import assert_f64_close, f64_rtol

DT = torch.float64
C = 0.05  # small enough that every example is clipped in some group


def gn_net():
    """Conv2d + GroupNorm + Linear, GroupNorm on 4-D and (after the flatten) on 2-D input."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.GroupNorm(4, 8),
        nn.Tanh(),
        nn.Conv2d(8, 16, 3, stride=2),
        nn.GroupNorm(2, 16),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 3 * 3, 12),
        nn.GroupNorm(3, 12),
        nn.Tanh(),
        nn.Linear(12, 10),
    ).to(DT)


def data(n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 7, 7, generator=g, dtype=DT), torch.randint(0, 10, (n,), generator=g)


def loop_reference(model, x, y, groups, max_norm):
    """Algorithm 1 read literally: one example at a time through plain autograd, clip, sum."""
    return loop_clipped_sum(model, x, y, groups, max_norm)


@pytest.mark.parametrize("clipping", ["global", "per_layer"])
@pytest.mark.parametrize("budget", [0, 2**30])  # book-keeping / kept per-example products
def test_ghost_equals_vmap_and_loop_with_groupnorm(clipping, budget):
    torch.manual_seed(0)
    model = gn_net()
    x, y = data()
    ghost = PerExampleClipper(model, C, clipping, "ghost", memory_budget_bytes=budget)
    assert sum(isinstance(l, GroupNormLayer) for l in ghost._layers) == 3
    assert not any(isinstance(l, GenericLayer) for l in ghost._layers) and ghost.native
    r_g = ghost.clipped_sum(x, y)
    r_v = PerExampleClipper(model, C, clipping, "vmap").clipped_sum(x, y)
    ref, ref_norms = loop_reference(model, x, y, ghost.groups, C)
    assert_close(r_g.grads, ref)
    assert_close(r_v.grads, ref)
    assert_f64_close(r_g.norms, ref_norms, f64_rtol(model))
    assert_f64_close(r_v.norms, ref_norms, f64_rtol(model))
    assert (ref_norms > C).any()  # clipping is exercised


def test_groupnorm_without_clipping_is_the_plain_gradient():
    torch.manual_seed(1)
    model = gn_net()
    x, y = data(5, 1)
    res = PerExampleClipper(model, None, "global", "ghost").clipped_sum(x, y)
    loss = F.cross_entropy(model(x), y, reduction="sum")
    names, params = zip(*model.named_parameters())
    assert_close(res.grads, dict(zip(names, torch.autograd.grad(loss, params))))


@pytest.mark.parametrize("shape", [(6, 4), (6, 4, 5), (6, 4, 3, 2, 2)])
def test_groupnorm_on_any_number_of_spatial_dims(shape):
    torch.manual_seed(2)
    model = nn.Sequential(
        nn.GroupNorm(2, 4),
        nn.Flatten(),
        nn.Linear(shape[1] * int(torch.tensor(shape[2:]).prod()), 3),
    ).to(DT)
    x, y = torch.randn(*shape, dtype=DT), torch.randint(0, 3, (shape[0],))
    ghost = PerExampleClipper(model, C, "per_layer", "ghost")
    ref, ref_norms = loop_reference(model, x, y, ghost.groups, C)
    r = ghost.clipped_sum(x, y)
    assert_close(r.grads, ref)
    assert_f64_close(r.norms, ref_norms, f64_rtol(model))


@pytest.mark.parametrize("frozen", ["weight", "bias", "both"])
@pytest.mark.parametrize("clipping", ["global", "per_layer"])
def test_frozen_groupnorm_parameters(frozen, clipping):
    torch.manual_seed(3)
    model = gn_net()
    for gn in (m for m in model if isinstance(m, nn.GroupNorm)):
        for attr in ("weight", "bias") if frozen == "both" else (frozen,):
            getattr(gn, attr).requires_grad_(False)
    x, y = data(6, 3)
    ghost = PerExampleClipper(model, C, clipping, "ghost")
    if frozen == "both":
        assert not any(isinstance(l, GroupNormLayer) for l in ghost._layers)
    r_g = ghost.clipped_sum(x, y)
    ref, ref_norms = loop_reference(model, x, y, ghost.groups, C)
    assert_close(r_g.grads, ref)
    assert_close(PerExampleClipper(model, C, clipping, "vmap").clipped_sum(x, y).grads, ref)
    assert_f64_close(r_g.norms, ref_norms, f64_rtol(model))


def test_groupnorm_without_affine_has_no_parameters_and_auto_picks_ghost():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4, affine=False), nn.Flatten(), nn.Linear(4 * 5 * 5, 3)
    ).to(DT)
    clipper = PerExampleClipper(model, C, "per_layer", "auto")
    assert clipper.mode == "ghost" and len(clipper.groups) == 2
    x, y = torch.randn(4, 3, 7, 7, dtype=DT), torch.randint(0, 3, (4,))
    ref, _ = loop_reference(model, x, y, clipper.groups, C)
    assert_close(clipper.clipped_sum(x, y).grads, ref)


def test_batchnorm_still_refused():
    with pytest.raises(ValueError, match="mixes examples"):
        PerExampleClipper(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), C)
