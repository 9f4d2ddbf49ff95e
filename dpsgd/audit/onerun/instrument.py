"""The audit's instrument: the canaries put into a run's data, its observers wired into the run's
parts, and, after the run, the scores of every canary (``dpsgd.run.parts.Instrument``).

The run itself is the user's training configuration, unchanged: its sampler draws the canaries'
rows like any other, its engine clips them, its noise, aggregator (torchrun), augmentation
multiplicity, momentum, EMA, ledger and stop rule all run as in training. Only ``audit.variant``
breaks something, on purpose (``variants.py``).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch

from dpsgd.core.checks import choice, num
from dpsgd.core.errors import ConfigError
from dpsgd.run.parts import Data, Instrument, project

from .canaries import CanaryDraw, GradientCanaries, add_canaries
from .observe import WhiteBoxObserver
from .placement import PLACEMENTS, NoSoftmaxLayer, place
from ..variants import VARIANTS, break_mechanism

SCORES = ("llr", "sum")
NORMALISE = ("measured", "claimed")
CANARIES_MAX = 10**6


@dataclass
class AuditOptions:
    """``audit.<key>=<value>`` on the command line of ``python -m dpsgd.audit run``."""

    gradient_canaries: int = 1000  # white-box: Dirac gradient canaries, scored on every iterate
    input_canaries: int = (
        1000  # black-box: mislabelled training examples, scored on the final model
    )
    variant: str = "correct"  # a broken mechanism to catch (variants.py); never a training option
    ranks: int = 4  # noise_per_rank: R
    canary_norm: float = 10.0  # a gradient canary's norm in each group, as a multiple of C (≥ 1)
    score: str = "llr"  # how gradient canaries are scored (observe.py), declared in advance
    detrend: int = 0  # τ > 0: subtract the running mean of a canary's past z (observe.py); 0: off
    # where gradient canaries live: dirac | null_space | null_space_dirac (placement.py)
    placement: str = "dirac"
    # z divided by the noise std measured across canaries, or the claimed σC (observe.py)
    normalise: str = "measured"
    beta: float = 0.05  # the bound holds with probability ≥ 1 − β
    seed: int = 0  # the canaries' bits, coordinates and wrong labels

    def validate(self) -> AuditOptions:
        """Coerce and check every field; ConfigError naming ``audit.<field>``."""
        for key in ("gradient_canaries", "input_canaries"):
            setattr(
                self,
                key,
                num(f"audit.{key}", getattr(self, key), integer=True, lo=0, hi=CANARIES_MAX),
            )
        if self.gradient_canaries + self.input_canaries == 0:
            raise ConfigError(
                "audit.gradient_canaries=0 and audit.input_canaries=0: nothing to audit"
            )
        choice("audit.variant", self.variant, VARIANTS)
        choice("audit.score", self.score, SCORES)
        choice("audit.placement", self.placement, PLACEMENTS)
        choice("audit.normalise", self.normalise, NORMALISE)
        self.ranks = num("audit.ranks", self.ranks, integer=True, lo=2, hi=1024)
        self.canary_norm = num("audit.canary_norm", self.canary_norm, lo=1, hi=1e6)
        self.beta = num("audit.beta", self.beta, lo=0, lo_open=True, hi=0.5)
        self.detrend = num("audit.detrend", self.detrend, integer=True, lo=0, hi=10**9)
        self.seed = num("audit.seed", self.seed, integer=True, lo=0, hi=2**62)
        if self.variant == "loose_group" and self.gradient_canaries == 0:
            raise ConfigError(
                "audit.variant=loose_group: acts on the gradient canaries; "
                "audit.gradient_canaries=0"
            )
        return self

    def summary(self) -> str:
        return (
            f"one-run audit, {self.gradient_canaries} gradient + {self.input_canaries} input "
            f"canaries, variant {self.variant}"
        )


class AuditInstrument(Instrument):
    """Canaries in the data, the gradient canaries in the engine,
    the white-box observer on the step."""

    def __init__(self, options: AuditOptions, classes: int):
        self.options = options
        self.classes = classes
        self.draw = CanaryDraw.draw(options.gradient_canaries, options.input_canaries, options.seed)
        self.label = {
            "kind": "one-run privacy audit (dpsgd.audit run)",
            "summary": options.summary(),
            "options": asdict(options),
            "note": "the training data holds the audit's canaries; this is not a training result",
        }
        self.canary_X = self.canary_y = None
        self.observer = None
        self.parts = None
        self.groups_used = 0
        self.placed = None

    def data(self, data: Data) -> Data:
        X, y, self.canary_X, self.canary_y = add_canaries(
            data.X_train, data.y_train, self.draw, self.classes, self.options.seed
        )
        return data._replace(X_train=X, y_train=y)

    def _place(self, p) -> tuple[dict, dict]:
        """The canaries' coordinates; a null-space placement on a model without a softmax output
        layer falls back to the Dirac placement, said in one line and labelled in audit.json."""
        o = self.options
        try:
            probe = p.transform.eval(p.data.X_train[:4]) if o.placement != "dirac" else None
            return place(
                p.clipper, o.gradient_canaries, o.seed, o.placement, self.classes, probe
            ), {}
        except NoSoftmaxLayer as e:
            reason = str(e).split(": ", 1)[1].split(";")[0]
            print(f"audit.placement={o.placement} does not apply ({reason}): the canaries are "
                  "placed by audit.placement=dirac instead (audit.json: canary_placement)")  # fmt: skip
            fallback = {"fallback_from": o.placement, "fallback_reason": reason}
            o.placement = "dirac"  # what every later step (and the independence claim) reads
            return place(p.clipper, o.gradient_canaries, o.seed, "dirac", self.classes), fallback

    def attach(self, parts) -> None:
        o, p = self.options, parts
        self.parts = p
        C, sigma, L = (
            p.dp.C,
            p.dp.sigma,
            p.dp.L,
        )  # the claimed mechanism's, before a variant breaks it
        break_mechanism(p, o.variant, o.ranks)
        if o.gradient_canaries:
            placed, fallback = self._place(p)
            self.groups_used = placed["groups_used"]
            self.placed = {
                "placement": o.placement,
                "normalise": o.normalise,
                "groups_used": placed["groups_used"],
                "null_space_groups": placed["null_groups"],
                "dirac_groups": placed["dirac_groups"],
            } | fallback
            if self.groups_used == 0:
                raise ConfigError(
                    f"audit.gradient_canaries={o.gradient_canaries}: no clipping group of this "
                    "model has that many coordinates (one per canary); use fewer"
                )
            p.dp.clipper = GradientCanaries(
                p.clipper,
                placed["coords"],
                self.draw.gradient_in,
                o.canary_norm * C,
                loose=2.0 if o.variant == "loose_group" else 1.0,
            )
            self.observer = WhiteBoxObserver(
                placed["coords"],
                self.groups_used,
                sigma,
                C,
                L,
                p.sampler.L / p.sampler.N,
                detrend=o.detrend,
                normalise=o.normalise,
            )
            self.observer.observe(p.dp)

    @torch.no_grad()
    def input_scores(self) -> torch.Tensor:
        """Black-box: the released model's logit margin of each input canary's (wrong) label."""
        p = self.parts
        X = project(
            Data(self.canary_X, self.canary_y, self.canary_X, self.canary_y), p.projection
        ).X_train
        X = X.to(p.device)
        with (
            p.ema.applied(p.model) if p.ema is not None else nullcontext(p.model) as model
        ):  # the released weights
            was = model.training
            model.eval()
            out = (
                torch.cat(
                    [model(p.transform.eval(X[s : s + 1000])) for s in range(0, len(X), 1000)]
                )
                .double()
                .cpu()
            )
            model.train(was)
        own = out.gather(1, self.canary_y[:, None]).squeeze(1)
        others = out.scatter(1, self.canary_y[:, None], float("-inf")).max(1).values
        return own - others
