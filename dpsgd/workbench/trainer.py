"""``dpsgd.PrivateTrainer``: DP-SGD (Abadi et al. 2016, Algorithm 1) on your own model and data.

It owns the mechanism (``build.assemble``: the sampler, the clipping engine, the noise and the event
each lot is charged as, the same builder the command line uses) and the ledger, and runs every lot
through ``lots.Lots.run`` (the command line's lot loop body), so each lot is charged as it runs and
nothing can be forgotten. Details and examples: docs/API.md.
"""

from __future__ import annotations

import math
import secrets

import torch

from dpsgd.accountant import Ledger
from dpsgd.accountant.ledger import EVENTS
from dpsgd.accountant.limits import DELTA_DEFAULT
from dpsgd.config.calibration import sigma_for_lots
from dpsgd.core.runtime import configure_threads
from dpsgd.mechanism.clipping.groups import clipping_groups
from dpsgd.mechanism import strategy as strategies
from dpsgd.mechanism.cyclic import make_run_sampler
from dpsgd.mechanism.noise import GaussianNoise
from dpsgd.workbench.build import assemble, planned_lots
from dpsgd.workbench.lots import Lots, Tally
from dpsgd.workbench.sources import as_tensors


class PrivateTrainer:
    """DP-SGD on any ``nn.Module``, every lot charged to its own ledger.

    Args:
        model: the network (a layer that mixes examples, such as BatchNorm, is refused, naming it).
        data: the training set: ``(X, y)`` tensors, a ``TensorDataset``, a ``Dataset`` of ``(x, y)``
            or an iterable of pairs; held in memory (``sources.as_tensors``).
        lot_size: L, the expected lot size (q = L/N).
        clip_norm: C, each example's gradient is clipped to norm C (per group with
            ``clipping="per_layer"``; the groups, and the k they are charged as, come from the
            model).
        sigma: the noise multiplier σ; give it, or ``target_epsilon`` and ``epochs`` to calibrate
            it. 0: clipped, not noised, not charged (ε = ∞).
        target_epsilon: training stops before the lot that would spend more (with ``sigma``), or
            σ is calibrated so that ``epochs`` spend it (without).
        epochs: the epochs ``fit`` runs by default, and the calibration's horizon.
        delta: δ of every ε reported.
        sampling: ``poisson`` (q = L/N), ``fixed_size``, ``truncated_poisson`` (with
            ``max_lot_size``), ``balls_in_bins`` or ``shuffle``; each charged by its own analysis.
        accountant: the accountant of ``epsilon`` and of the stop; None: the first the sampler's
            event is served by (Poisson: the paper's moments accountant).
        loss: ``loss(output, target) -> [B]``, one value per example (``reduction="none"``); None:
            cross-entropy.
        lr, momentum: the update θ ← θ − η g̃ (with momentum μ: heavy ball on g̃).
        clipping, mode: ``global`` or ``per_layer``; the engine ``auto``, ``ghost`` or ``vmap``.
        physical_batch_size: the most examples per forward pass (None: the whole lot).
        private: False runs the same loop without clipping, noise or charge (ε = ∞).
        seed: the sampler's and the noise's seeds (None: drawn from the OS).
        secure_rng: draw the noise from OS entropy (a seed is then refused).
        threads: torch's intra-op threads: None applies the command line's policy (DPSGD_THREADS,
            OMP_NUM_THREADS, the machine), an int sets it, False leaves torch alone.
        logger: anything with ``log(row, step)``, e.g. ``dpsgd.core.loggers.make_logger(
            "tensorboard", folder)``: after each whole epoch, a row (epoch, steps, lot_loss,
            epsilon, sigma, q, C, L) with the epoch as the step; you close it.
        noise: ``independent`` (Algorithm 1), ``bandmf`` or ``blt``: correlated noise (DP matrix
            factorisation, docs/CORRELATED_NOISE.md) under its cyclic participation (``sampling=
            "poisson"`` becomes cyclic_poisson for BandMF, cyclic for BLT); its strategy is
            optimised for the lots ``epochs`` (or the target ε) plan.
        bands, blt_buffers: b of BandMF (1: Algorithm 1's noise), at most d buffers of BLT.

    Raises:
        ValueError: one line naming the argument, before any lot runs.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        data,
        *,
        lot_size: int,
        clip_norm: float = 1.0,
        sigma: float | None = None,
        target_epsilon: float | None = None,
        epochs: float | None = None,
        delta: float = DELTA_DEFAULT,
        sampling: str = "poisson",
        max_lot_size: int | None = None,
        accountant: str | None = None,
        loss=None,
        lr: float = 0.1,
        momentum: float = 0.0,
        clipping: str = "global",
        mode: str = "auto",
        physical_batch_size: int | None = None,
        private: bool = True,
        seed: int | None = None,
        secure_rng: bool = False,
        threads: int | bool | None = None,
        logger=None,
        noise: str = "independent",
        bands: int | None = None,
        blt_buffers: int = 4,
    ):
        correlated = {"noise_kind": noise, "bands": bands, "blt_buffers": blt_buffers}
        self.threads = _threads(threads)
        self.logger = logger
        self.X, self.y = as_tensors(data)
        self.device = next(model.parameters()).device
        self.X, self.y = self.X.to(self.device), self.y.to(self.device)
        self.model, self.delta, self.epochs = model, float(delta), epochs
        self.target_epsilon, self.physical_batch_size = target_epsilon, physical_batch_size
        self.convention = "joint"  # k groups = one Gaussian at σ/√k (the correct charge)
        seed = secrets.randbits(62) if seed is None else int(seed)
        noise = GaussianNoise(
            seed=None if secure_rng else seed + 1, secure=secure_rng, device=self.device
        )
        build = dict(
            lot_size=lot_size,
            clip_norm=clip_norm,
            noise=noise,
            sampler_seed=seed,
            lr=lr,
            private=private,
            sampling=sampling,
            max_lot_size=max_lot_size,
            clipping=clipping,
            mode=mode,
            momentum=momentum,
            loss=loss,
            **correlated,
        )
        sigma = self._sigma(sigma, private, build, accountant)
        self.clipper, self.sampler, self.plan, self.dp = assemble(
            model,
            len(self.X),
            sigma=sigma,
            horizon=self._horizon(build, sigma, accountant),
            **build,
        )
        self.accountant = accountant or (self.plan.accountants or ("rdp",))[0]
        if self.plan.private and self.accountant not in self.plan.accountants:
            raise ValueError(
                f"accountant={accountant!r}: {sampling} lots are served by "
                f"{list(self.plan.accountants)}"
            )
        self.tally = Tally(Ledger())
        self.lots = Lots(self.plan, self.dp, self.tally)
        self.epoch = 0
        self.tally.budget = self._budget()

    # -- set-up ----------------------------------------------------------------------------------

    def _sigma(self, sigma, private: bool, build: dict, accountant) -> float:
        """σ as given, or calibrated for ``epochs`` at ``target_epsilon``."""
        if not private:
            return 0.0
        if sigma is not None:
            if not float(sigma) >= 0:
                raise ValueError(f"sigma={sigma!r} must be >= 0")
            return float(sigma)
        if self.target_epsilon is None or self.epochs is None:
            raise ValueError("sigma=None: give sigma, or target_epsilon and epochs to calibrate it")
        sampler = self._sampler(build)
        lots = math.ceil(self.epochs * sampler.lots_per_epoch())
        k = len(clipping_groups(self.model, build["clipping"]))
        name = accountant or EVENTS[sampler.event(1.0, k).entry()["event"]][0]
        return sigma_for_lots(
            sampler, self.target_epsilon, self.delta, lots, name, k, self.convention
        )

    def _sampler(self, build: dict):
        """A sampler like the run's (its lots per epoch, its charges), for the set-up's searches."""
        return make_run_sampler(
            build["noise_kind"],
            build["sampling"],
            len(self.X),
            build["lot_size"],
            None,
            build["max_lot_size"],
            build["bands"],
        )

    def _horizon(self, build: dict, sigma: float, accountant) -> int | None:
        """The lots a correlated-noise strategy is optimised for: ``epochs`` of lots, fewer where the
        target ε stops first (``planned_lots``); None without correlated noise."""
        if build["noise_kind"] == "independent" or not (build["private"] and sigma > 0):
            return None
        sampler = self._sampler(build)
        if self.epochs is None and self.target_epsilon is None:
            raise ValueError(
                f"noise={build['noise_kind']!r}: give epochs (or target_epsilon), the horizon its "
                "strategy is optimised for"
            )
        k = len(clipping_groups(self.model, build["clipping"]))
        lots = (
            math.ceil(self.epochs * sampler.lots_per_epoch()) if self.epochs is not None else 10**7
        )
        name = accountant or EVENTS[sampler.event(1.0, k).entry()["event"]][0]
        return planned_lots(
            sampler, sigma, k, lots, self.target_epsilon, self.delta, name, self.convention
        )

    def _budget(self) -> int | None:
        """Charges that still fit within the target ε, from the ledger (None: no target)."""
        if self.target_epsilon is None or not self.plan.private:
            return None
        return int(
            self.tally.ledger.steps_within(
                self.target_epsilon, self.delta, self.plan.event, self.accountant, self.convention
            )
        )

    # -- training --------------------------------------------------------------------------------

    def fit(self, epochs: float | None = None) -> str:
        """Train for ``epochs`` (default: the constructor's) more epochs, or until the target ε
        stops it; returns why it stopped: ``epochs_completed`` or ``target_epsilon_reached``."""
        epochs = self.epochs if epochs is None else epochs
        if epochs is None:
            raise ValueError("fit: give epochs (here or to the constructor)")
        whole, part = int(epochs), epochs - int(epochs)
        cycle = getattr(self.sampler, "cycle", 1)  # cyclic participation: whole cycles only
        for e in range(whole + (1 if part > 0 else 0)):
            limit = None if e < whole else round(part * self.sampler.lots_per_epoch())
            limit = limit if limit is None else -(-limit // cycle) * cycle
            if self.train_epoch(limit) == "target_epsilon_reached":
                return "target_epsilon_reached"
        return "epochs_completed"

    def train_epoch(self, max_lots: int | None = None) -> str | None:
        """One epoch of lots (the first ``max_lots`` of it); ``target_epsilon_reached`` when the
        target ε stopped it before its end, else None. Returns the mean loss per example on
        ``self.last_loss``."""
        loss, seen = 0.0, 0
        for i, idx in enumerate(self.sampler.epoch()):
            if max_lots is not None and i >= max_lots:
                break
            left = self.lots.left(i)
            if left is not None and left <= 0:
                self.last_loss = loss / max(1, seen)
                return "target_epsilon_reached"
            x, y, kw = self._lot(idx)
            out = self.lots.run(i, x, y, self.physical_batch_size, **kw)
            loss, seen = loss + float(out["loss_sum"]), seen + int(out["lot_size"])
        self.epoch += 1
        self.last_loss = loss / max(1, seen)
        if self.logger is not None:  # one row per whole epoch, the epoch its step
            self.logger.log(self.row(), self.epoch)
        return None

    def row(self) -> dict:
        """What a logger gets after an epoch: where training stands and what it has spent."""
        p = self.plan
        return {
            "epoch": self.epoch,
            "steps": self.steps,
            "lot_loss": self.last_loss,
            "epsilon": self.epsilon,
            "sigma": p.sigma,
            "q": self.sampler.q,
            "C": p.clip_norm,
            "L": p.lot_size,
        }

    def _lot(self, idx: torch.Tensor):
        """The lot's examples on the device (padded with zero-weight rows when the sampler pads)."""
        kw = {}
        if self.sampler.pads:
            idx, kw["weights"] = self.sampler.padded(idx)
        idx = idx.to(self.device)
        return self.X.index_select(0, idx), self.y.index_select(0, idx), kw

    # -- what it has spent -----------------------------------------------------------------------

    @property
    def ledger(self) -> Ledger:
        return self.tally.ledger

    @property
    def steps(self) -> int:
        """Lots run."""
        return self.tally.steps

    @property
    def epsilon(self) -> float:
        """ε at δ of every lot run so far (∞ when not private: nothing bounds it)."""
        if not self.plan.private:
            return math.inf
        return float(self.ledger.epsilon(self.delta, self.accountant, self.convention)[0])

    def _epsilon_by(self, accountant: str) -> float | None:
        """ε under ``accountant``; None where it refuses this ledger (e.g. too small a σ)."""
        try:
            return float(self.ledger.epsilon(self.delta, accountant, self.convention)[0])
        except ValueError:
            return None

    def statement(self) -> dict:
        """What was spent and how it was charged, with ε under every accountant that serves it."""
        s, plan = self.sampler, self.plan
        eps = {a: self._epsilon_by(a) for a in plan.accountants}
        return {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "accountant": self.accountant,
            "epsilon_by_accountant": eps,
            "private": plan.private,
            "steps": self.steps,
            "epochs": self.epoch,
            "sampling": {"name": s.name, "N": len(self.X), "L": plan.lot_size, "q": s.q},
            "sigma": plan.sigma,
            "clip_norm": plan.clip_norm,
            "groups": plan.groups,
            "adjacency": plan.adjacency,
            "ledger": self.ledger.to_dict(),
            **(
                {}
                if plan.strategy is None
                else {
                    "correlated_noise": {
                        "strategy": plan.strategy.to_dict(),
                        "noise_multiplier_per_step": strategies.noise_multiplier_per_step(
                            plan.strategy
                        ),
                        "expected_error_ratio": strategies.expected_error_ratio(plan.strategy),
                    }
                }
            ),
        }

    # -- saving and loading ----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything to continue exactly: the weights, the momentum, the generators, the ledger."""
        return {
            "model": {n: v.detach().cpu() for n, v in self.model.state_dict().items()},
            "optimizer": self.dp.state_dict(),
            "sampler": self.sampler.state_dict(),
            "noise": self.dp.noise.state_dict(),
            "ledger": self.ledger.to_dict(),
            "steps": self.steps,
            "epoch": self.epoch,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``; the budget of the target ε is recomputed from the
        ledger."""
        self.model.load_state_dict(state["model"])
        self.dp.load_state_dict(state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])
        self.dp.noise.load_state_dict(state["noise"])
        self.tally.ledger = Ledger.from_dict(state["ledger"])
        self.tally.steps, self.epoch = int(state["steps"]), int(state["epoch"])
        self.tally.budget = self._budget()


def _threads(threads) -> int | None:
    """Apply the thread policy (None), a number of threads (int), or nothing (False)."""
    if threads is False:
        return None
    if threads is None or threads is True:
        return configure_threads()["threads"]
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads={threads!r} must be a positive integer, None or False")
    torch.set_num_threads(threads)
    return threads
