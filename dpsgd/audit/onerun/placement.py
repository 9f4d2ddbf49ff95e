"""Where a gradient canary lives: ``audit.placement`` (docs/AUDIT_MATH.md §6).

* ``dirac`` (Nasr et al. 2023): one random coordinate per canary in every clipping group with at
  least m coordinates; the real examples' gradients land there too (interference).
* ``null_space``: only the *class-sum directions* of the softmax output layer, along which no real
  example's gradient has a component (softmax ignores a shift of all logits), so each canary sees
  exactly its own B_t·C + N(0, σ²C²), independent of the other canaries and of the data. Groups
  holding no such direction get no canary (k_used may be below the claim's k: valid, lower power).
* ``null_space_dirac``: the class-sum directions in the output layer's group(s), plus a Dirac
  coordinate in every other group with at least m coordinates (k_used = k; interference there).

``place`` returns ``{"coords": {param name: [m] or [m, r] flat indices (−1: none)}, "groups_used",
"null_groups", "dirac_groups"}``; a canary's direction in a parameter is the sum of its r entries'
unit vectors divided by √r (r = 1 for Dirac, r = K for a class-sum direction).

Details (why the class-sum directions are null): docs/AUDIT.md, "dpsgd/audit/onerun/placement.py".
"""

from __future__ import annotations

import torch
from torch import nn

from dpsgd.core.errors import ConfigError

PLACEMENTS = ("dirac", "null_space", "null_space_dirac")


class NoSoftmaxLayer(ConfigError):
    """The model has no softmax output layer: the null-space placements do not apply to it."""


def output_layer(model: nn.Module, classes: int, probe: torch.Tensor) -> tuple[str, nn.Linear]:
    """(module name, module) of the softmax output layer: the ``nn.Linear`` with ``classes`` outputs
    whose output *is* the model's output on ``probe`` (checked by a forward hook, so nothing after
    it mixes the logits). ConfigError naming ``audit.placement`` when there is none."""
    cands = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and m.out_features == classes and m.weight.requires_grad
    ]
    seen = {}
    hooks = [
        m.register_forward_hook(lambda mod, inp, out, n=n: seen.__setitem__(n, out))
        for n, m in cands
    ]
    try:
        with torch.no_grad():
            out = model(probe)
    finally:
        for h in hooks:
            h.remove()
    for n, m in reversed(cands):
        if n in seen and seen[n] is out:
            return n, m
    raise NoSoftmaxLayer(
        "audit.placement=null_space: this model has no softmax output layer (a trainable nn.Linear "
        f"with {classes} outputs whose output is the logits); use audit.placement=dirac"
    )


def class_sum_directions(layer_name: str, layer: nn.Linear) -> dict:
    """{parameter name: [n_dirs, K] flat indices}: one class-sum direction per column of W (and one
    for the bias, if trainable), each as the K flat indices of its entries."""
    K, H = layer.weight.shape
    prefix = f"{layer_name}." if layer_name else ""
    out = {
        prefix + "weight": torch.arange(K)[None, :] * H + torch.arange(H)[:, None]
    }  # column j: j, H+j, ...
    if layer.bias is not None and layer.bias.requires_grad:
        out[prefix + "bias"] = torch.arange(K)[None, :]
    return out


def place(
    clipper,
    m: int,
    seed: int,
    placement: str = "dirac",
    classes: int | None = None,
    probe: torch.Tensor | None = None,
) -> dict:
    """The canaries' directions (module doc); ConfigError naming the option when they do not fit."""
    gen = torch.Generator().manual_seed(seed + 2)
    params = dict(clipper.model.named_parameters())
    coords: dict = {n: torch.full((m,), -1, dtype=torch.long) for g in clipper.groups for n in g}
    null = {}
    if placement != "dirac":
        null = class_sum_directions(*output_layer(clipper.model, classes, probe))
    used = n_null = n_dirac = 0
    for group in clipper.groups:
        mine = [n for n in group if n in null]
        if mine:
            dirs = sum(len(null[n]) for n in mine)
            if dirs < m:
                raise ConfigError(
                    f"audit.gradient_canaries={m}: audit.placement={placement} has {dirs} "
                    "class-sum directions in the output layer's clipping group (one per canary); "
                    "use at most that"
                )
            pick = torch.randperm(dirs, generator=gen)[:m]
            start = 0
            for n in mine:
                K = null[n].shape[1]
                idx = torch.full((m, K), -1, dtype=torch.long)
                sel = (pick >= start) & (pick < start + len(null[n]))
                idx[sel] = null[n][pick[sel] - start]
                coords[n] = idx
                start += len(null[n])
            used, n_null = used + 1, n_null + 1
            continue
        if placement == "null_space":
            continue
        sizes = [params[n].numel() for n in group]
        if sum(sizes) < m or m == 0:
            continue
        used, n_dirac = used + 1, n_dirac + 1
        flat = torch.randperm(sum(sizes), generator=gen)[:m]
        start = 0
        for n, size in zip(group, sizes):
            sel = (flat >= start) & (flat < start + size)
            coords[n][sel] = flat[sel] - start
            start += size
    return {"coords": coords, "groups_used": used, "null_groups": n_null, "dirac_groups": n_dirac}


def as_rows(idx: torch.Tensor) -> torch.Tensor:
    """A placement's [m] or [m, r] index as [m, r]."""
    return idx[:, None] if idx.dim() == 1 else idx
