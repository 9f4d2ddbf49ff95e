"""Layer rules of the ghost engine, registered by module type.

A layer rule (a subclass of ``layers._Layer``) computes, from one module's input a and output
gradient b, the per-example squared norms of the gradients of the parameters that module owns and
their clipped sum by book-keeping (Bu et al. 2023; Goodfellow 2015). Rules are registered for the
module type they are exact for, as Opacus registers its per-sample gradient samplers::

    @register_layer(nn.Linear)
    class LinearLayer(_Layer): ...

``registered_rule(module)`` looks the module's exact type up first, then its base classes in
method resolution order. A rule found on a base class applies only if the module keeps that base
class's ``forward``: a subclass that overrides it may use its parameters in any way, and gets no
rule. A module type registered nowhere in its MRO may still match a rule by its structure
(``register_structural``: Hugging Face defines one RMSNorm class per model family, ``LlamaRMSNorm``,
``GemmaRMSNorm``, ...); such a rule is exact only if the module computes what it assumes, which the
proof checks on the first call of each input signature (proof.py) before the rule runs. The ghost
engine (``ghost.build_layers``) runs a module without a rule through the generic
per-module vmap rule when it is a leaf, and declines the model otherwise.
"""

from __future__ import annotations

from torch import nn

LAYER_RULES: dict[type, type] = {}  # module type -> layer rule class
STRUCTURAL_RULES: list[tuple] = []  # (predicate(module) -> bool, layer rule class), in order


def register_layer(*module_types: type):
    """Class decorator: the decorated rule handles modules of ``module_types`` (and of subclasses
    that keep their ``forward``). A later registration for the same type replaces the earlier."""
    if not module_types:
        raise TypeError("register_layer needs at least one module type")
    for t in module_types:
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise TypeError(f"register_layer: {t!r} is not a subclass of torch.nn.Module")

    def decorate(rule: type) -> type:
        for t in module_types:
            LAYER_RULES[t] = rule
        return rule

    return decorate


def register_structural(predicate):
    """Class decorator: the decorated rule handles modules for which ``predicate(module)`` holds
    and whose type (and MRO) has no registered rule; the first matching predicate wins."""
    if not callable(predicate):
        raise TypeError(f"register_structural: {predicate!r} is not callable")

    def decorate(rule: type) -> type:
        STRUCTURAL_RULES.append((predicate, rule))
        return rule

    return decorate


def registered_rule(module: nn.Module) -> type | None:
    """The rule for ``module``: registered for its exact type, else for the nearest base class in
    its MRO whose ``forward`` it keeps (None when that class's forward is overridden), else the
    first structural rule whose predicate it meets; None when there is none."""
    kind = type(module)
    for cls in kind.__mro__:
        rule = LAYER_RULES.get(cls)
        if rule is not None:
            return rule if kind.forward is cls.forward else None
    return next((rule for match, rule in STRUCTURAL_RULES if match(module)), None)
