"""Which tensors form a clipping group: the one rule the engines, σ calibration and the ledger's k
share.

Algorithm 1 of Abadi et al. 2016 clips each example's gradient to norm C. The paper's experiments
clip per layer: each layer's gradient to C on its own, so a lot releases k noisy blocks, and the
accountant charges them as one Gaussian mechanism of sensitivity √k·C
(``dpsgd/accountant/compose.py``, convention ``joint``). k must therefore be the number of groups
the engine actually clips.

* ``clipping="global"``: one group, every trainable parameter.
* ``clipping="per_layer"``: one group per module owning trainable parameters (``recurse=False``:
  weight + bias of a Linear, γ + β of a GroupNorm), in ``named_modules`` order.
* Frozen parameters (``requires_grad=False``, e.g. the public pretrained convolutions of §5.3) are
  in no group: they get no gradient, no clipping and no noise, and a module owning only frozen
  parameters adds nothing to k.

Details: docs/PERFORMANCE.md, "dpsgd/mechanism/clipping/groups.py".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .clip import CLIPPINGS


@dataclass(frozen=True)
class Owner:
    """A module owning trainable parameters: the ones it owns first, and aliases of earlier ones."""

    name: str  # module path in ``named_modules`` ("" for the root)
    module: nn.Module
    params: dict[str, str]  # attribute -> full parameter name (first owner: this module)
    aliases: dict[str, str] = field(
        default_factory=dict
    )  # attribute -> full name at its first owner


def owners(model: nn.Module) -> list[Owner]:
    """Every module that owns trainable parameters, in ``named_modules`` order.

    A parameter registered in several modules is in ``params`` of its first owner only; the later
    owners list it in ``aliases``. A module whose trainable parameters are all aliases is listed
    (its ``params`` empty) so that the ghost engine can name it; it forms no group."""
    first: dict[int, str] = {}
    out = []
    for mname, m in model.named_modules():
        params, aliases = {}, {}
        for attr, p in m.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            full = f"{mname}.{attr}" if mname else attr
            if id(p) in first:
                aliases[attr] = first[id(p)]
            else:
                first[id(p)] = params[attr] = full
        if params or aliases:
            out.append(Owner(mname, m, params, aliases))
    return out


def clipping_groups(model: nn.Module, clipping: str) -> list[list[str]]:
    """The groups clipped separately to C: lists of trainable parameter names (k = len)."""
    if clipping not in CLIPPINGS:
        raise ValueError(f"clipping={clipping!r} must be one of {CLIPPINGS}")
    own = [list(o.params.values()) for o in owners(model) if o.params]
    if not own:
        raise ValueError("model has no trainable parameters (requires_grad=True)")
    return [[n for g in own for n in g]] if clipping == "global" else own
