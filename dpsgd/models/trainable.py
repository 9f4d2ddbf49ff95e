"""Which parameters fine-tuning trains: ``trainable(model, "bias")`` in one line, and LoRA adapters
(``add_lora``, through ``peft``).

DP-SGD clips, noises and updates the trainable parameters only (requires_grad=True): a frozen
parameter gets no gradient, is in no clipping group (so not in the k the accountant charges, see
dpsgd/mechanism/clipping/groups.py), receives no noise and never moves. Choosing what trains is
therefore all parameter-efficient fine-tuning needs from the mechanism; the choices here are the
ones the DP fine-tuning literature compares:

  all    every parameter (full fine-tuning; training from scratch)
  bias   the bias terms only: BiTFiT (Ben Zaken et al. 2022, arXiv 2106.10199), DP-BiTFiT (Bu et
         al. 2024, arXiv 2210.00036): ~0.1 % of a transformer's parameters; the ghost rules then
         keep no layer input for the frozen weights (layers.py: ``needs_input``)
  head   the last module owning parameters (``head=`` names another): a linear probe on frozen
         features (Tramèr & Boneh 2021; De et al. 2022's last-layer fine-tuning)
  norm   the affine parameters of LayerNorm, GroupNorm and RMSNorm modules
  lora   the LoRA adapters (Hu et al. 2022, arXiv 2106.09685; DP: Yu et al. 2022, arXiv
         2110.06500) that ``add_lora`` or ``peft`` inserted: lora_A and lora_B of each adapted
         layer, the base weight frozen

joined with ``+`` ("bias+head", "lora+head": a new task's randomly initialised head is usually
trained too). Everything not selected is frozen. Used by the command line (``model.trainable``,
applied in dpsgd/run/parts.py:init_model and counted in the σ calibration's k) and the Python API
alike (``dpsgd.trainable``, ``dpsgd.add_lora``).
"""

from __future__ import annotations

import re

from torch import nn

PARTS = ("all", "bias", "head", "norm", "lora")
NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
LORA = re.compile(r"(^|\.)lora_(A|B|embedding_A|embedding_B|magnitude_vector)(\.|$)")


def parse(which: str) -> tuple[str, ...]:
    """The parts of a selection ("bias+head" -> ("bias", "head")); ValueError naming a bad one."""
    if not isinstance(which, str) or not which.strip():
        raise ValueError(f"trainable={which!r}: one of {', '.join(PARTS)}, or several joined by +")
    parts = tuple(p.strip() for p in which.split("+"))
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise ValueError(
            f"trainable={which!r}: {bad[0]!r} is not one of {', '.join(PARTS)} (join several "
            "with +, e.g. bias+head)"
        )
    if "all" in parts and len(parts) > 1:
        raise ValueError(f"trainable={which!r}: 'all' already selects every parameter")
    if len(set(parts)) != len(parts):
        raise ValueError(f"trainable={which!r}: a part is named twice")
    return parts


def default_head(model: nn.Module) -> str:
    """The module path of the head: the last module in ``named_modules`` order that owns
    parameters, skipping LoRA adapters and the frozen original of a ``peft`` ModulesToSaveWrapper
    (whose trained copy is the one that runs)."""
    head = None
    for name, m in model.named_modules():
        if LORA.search(name) or re.search(r"(^|\.)original_module(\.|$)", name):
            continue
        if next(m.parameters(recurse=False), None) is not None:
            head = name
    if head is None:
        raise ValueError("trainable: the model has no parameters")
    return head


def selected(model: nn.Module, which: str, head: str | None = None) -> list[str]:
    """The names of the parameters ``which`` selects (nothing changed)."""
    parts = parse(which)
    if "all" in parts:
        return [n for n, _ in model.named_parameters()]
    modules = dict(model.named_modules())
    if head is not None and head not in modules:
        raise ValueError(f"trainable: head={head!r} is no module of the model")
    head = default_head(model) if "head" in parts and head is None else head
    norm_paths = {n for n, m in modules.items() if isinstance(m, NORMS)}
    out = []
    for part in parts:
        if part == "bias":
            names = [n for n, _ in model.named_parameters() if n.rpartition(".")[2] == "bias"]
        elif part == "head":
            prefix = f"{head}." if head else ""
            names = [n for n, _ in model.named_parameters() if n.startswith(prefix)]
        elif part == "norm":
            names = [n for n, _ in model.named_parameters() if n.rpartition(".")[0] in norm_paths]
        else:
            names = [n for n, _ in model.named_parameters() if LORA.search(n)]
        if not names:
            hint = " (add_lora, or peft, inserts them)" if part == "lora" else ""
            raise ValueError(f"trainable={which!r}: the model has no {part} parameters{hint}")
        out += [n for n in names if n not in out]
    return out


def trainable(model: nn.Module, which: str = "all", head: str | None = None) -> list[str]:
    """Train the parameters ``which`` selects and freeze every other one (requires_grad), in place;
    returns the names of the trainable parameters.

    Args:
        model: the network (build the clipper and the optimiser after this call: the clipper
            refuses a change of requires_grad after it was built).
        which: ``all``, ``bias``, ``head``, ``norm``, ``lora`` or several joined by ``+``.
        head: the module path of the head for ``head`` (default: ``default_head``).

    Raises:
        ValueError: one line, naming the selection, when a part selects nothing."""
    keep = set(selected(model, which, head))
    for n, p in model.named_parameters():
        p.requires_grad_(n in keep)
    return [n for n, p in model.named_parameters() if p.requires_grad]


def add_lora(
    model: nn.Module,
    rank: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    targets: list[str] | None = None,
    head: str | None = None,
) -> nn.Module:
    """Insert LoRA adapters W + (α/r)·B·A into ``model``'s Linear layers, in place, through
    ``peft.inject_adapter_in_model`` (the optional extra ``dpsgd[peft]``); returns the model with
    only the adapters trainable (``trainable(model, "lora+head")`` trains its head too).

    Each adapted layer becomes a peft ``lora.Linear`` whose lora_A and lora_B are nn.Linear modules,
    so the ghost engine clips them with its Linear rule, exactly (each called once per forward
    pass, on the dropout of the layer's input).

    Args:
        rank, alpha, dropout: r, α and the dropout on the adapters' input.
        targets: the module paths adapted (default: every nn.Linear but the head).
        head: the head's module path (default: ``default_head``), never adapted by default."""
    try:
        import peft
    except ImportError:
        raise ValueError("LoRA needs the peft package: pip install 'dpsgd[peft]'") from None
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"add_lora: rank={rank!r} must be a positive integer")
    if not alpha > 0:
        raise ValueError(f"add_lora: alpha={alpha!r} must be > 0")
    if not 0 <= dropout < 1:
        raise ValueError(f"add_lora: dropout={dropout!r} must be in [0, 1)")
    modules = dict(model.named_modules())
    if targets is None:
        head = default_head(model) if head is None else head
        targets = [n for n, m in modules.items() if isinstance(m, nn.Linear) and n and n != head]
    bad = [t for t in targets if not isinstance(modules.get(t), nn.Linear)]
    if bad or not targets:
        raise ValueError(
            f"add_lora: {f'{bad[0]!r} is no nn.Linear of the model' if bad else 'no Linear layer'}"
            " to adapt"
        )
    pattern = "^(" + "|".join(re.escape(t) for t in targets) + ")$"
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=pattern)
    return peft.inject_adapter_in_model(cfg, model)


def fine_tune(
    model: nn.Module, which: str = "all", lora_rank: int = 8, lora_alpha: float = 16.0
) -> nn.Module:
    """The command line's ``model.trainable``, in place: nothing for ``all`` (the model and
    ``model.freeze`` decide what trains, as before the option existed); else LoRA adapters of rank
    ``lora_rank`` where ``lora`` is named (``add_lora``), then ``trainable(model, which)``."""
    parts = parse(which)
    if parts == ("all",):
        return model
    if "lora" in parts:
        add_lora(model, lora_rank, lora_alpha)
    trainable(model, which)
    return model
