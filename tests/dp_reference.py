"""Algorithm 1 read literally, for tests: one example at a time through plain autograd, clip, sum.

``loop_clipped_sum(model, rows, y, groups, C, K)``: rows holds K consecutive copies of each example
(K = 1: the examples themselves); example i's gradient is the mean of its K copies' gradients
(augmentation multiplicity, De et al. 2022), clipped per group of parameter names to norm C, summed.
Returns (Σ_i clip(g_i) per parameter, per-example group norms [B, groups])."""

import torch
import torch.nn.functional as F

from tolerances import reduction_rtol


def loop_clipped_sum(model, rows, y, groups, C, K=1):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sums = {n: torch.zeros_like(p) for n, p in named}
    norms = []
    for i in range(len(y)):
        grads = [
            torch.autograd.grad(
                F.cross_entropy(model(rows[i * K + k : i * K + k + 1]), y[i : i + 1]),
                [p for _, p in named],
            )
            for k in range(K)
        ]
        g = {n: sum(gk[j] for gk in grads) / K for j, (n, _) in enumerate(named)}
        row = []
        for names in groups:
            nrm = torch.sqrt(sum(g[n].pow(2).sum() for n in names))
            row.append(nrm)
            for n in names:
                sums[n] += g[n] * min(1.0, C / nrm.item())
        norms.append(torch.stack(row))
    return sums, torch.stack(norms)


def assert_close(a, b, rtol=None):
    """Per-parameter relative error <= rtol (float64), with an absolute floor of rtol times the
    largest parameter's gradient norm (an entry 0 in exact arithmetic is round-off at that scale).
    rtol defaults to reduction_rtol(P), P the number of gradient entries: every entry and norm is a
    chain of reductions over at most P terms (tests/tolerances.py)."""
    assert a.keys() == b.keys()
    if rtol is None:
        rtol = reduction_rtol(sum(t.numel() for t in b.values()))
    scale = max(t.norm().item() for t in b.values())
    for n in a:
        err = (a[n] - b[n]).norm().item()
        assert err <= rtol * (b[n].norm().item() + scale), (n, err)
