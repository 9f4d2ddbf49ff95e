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
from dpsgd.accountant.limits import DELTA_DEFAULT
from dpsgd.config.arguments import check_arguments, check_calibrated
from dpsgd.config.calibration import sigma_for_lots
from dpsgd.core.runtime import configure_threads
from dpsgd.mechanism.clipping.groups import clipping_groups
from dpsgd.mechanism.noise import GaussianNoise
from dpsgd.mechanism.sampling import make_sampler
from dpsgd.workbench.build import PROOF_SAMPLE, assemble
from dpsgd.workbench.lots import Lots, Tally
from dpsgd.workbench.sources import as_tensors
from dpsgd.workbench.states import check_state, data_sha256


class PrivateTrainer:
    """DP-SGD on any ``nn.Module``, every lot charged to its own ledger.

    Args:
        model: the network (a layer that mixes examples, such as BatchNorm, is refused, naming it,
            and so is a forward pass that mixes them: the clipper's proof on the first examples).
        data: the training set: ``(X, y)`` tensors, a ``TensorDataset``, a ``Dataset`` of ``(x, y)``
            or an iterable of pairs; held in memory (``sources.as_tensors``).
        lot_size: L, the expected lot size (q = L/N).
        clip_norm: C, each example's gradient is clipped to norm C (per group with
            ``clipping="per_layer"``; the groups, and the k they are charged as, come from the
            model).
        sigma: the noise multiplier σ; give it, or ``target_epsilon`` and ``epochs`` to calibrate
            it. A private trainer needs σ > 0, as the command line does (a run without noise:
            ``private=False``).
        target_epsilon: training stops before the lot that would spend more (with ``sigma``), or
            σ is calibrated so that ``epochs`` spend it (without).
        epochs: the epochs ``fit`` runs by default, and the calibration's horizon.
        delta: δ of every ε reported; below 1/N unless ``allow_large_delta``.
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
        allow_large_delta: accept δ >= 1/N (``privacy.allow_large_delta``).
        threads: torch's intra-op threads: None applies the command line's policy (DPSGD_THREADS,
            OMP_NUM_THREADS, the machine), an int sets it, False leaves torch alone.
        logger: anything with ``log(row, step)``, e.g. ``dpsgd.core.loggers.make_logger(
            "tensorboard", folder)``: after each whole epoch, a row (epoch, steps, lot_loss,
            epsilon, sigma, q, C, L) with the epoch as the step; you close it.

    Every argument is checked by the command line's own validators (dpsgd/config/arguments.py:
    one validation, two callers), before any lot runs.

    Raises:
        ValueError: one line naming the argument (the command line's refusal, in the API's words).
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
        allow_large_delta: bool = False,
    ):
        self.X, self.y = as_tensors(data)
        a = check_arguments(
            len(self.X),
            lot_size=lot_size,
            clip_norm=clip_norm,
            sigma=sigma,
            target_epsilon=target_epsilon,
            epochs=epochs,
            delta=delta,
            sampling=sampling,
            max_lot_size=max_lot_size,
            accountant=accountant,
            lr=lr,
            momentum=momentum,
            clipping=clipping,
            mode=mode,
            physical_batch_size=physical_batch_size,
            private=private,
            seed=seed,
            secure_rng=secure_rng,
            allow_large_delta=allow_large_delta,
        )
        self.args, self.threads, self.logger = a, _threads(threads), logger
        self.device = next(model.parameters()).device
        self.X, self.y = self.X.to(self.device), self.y.to(self.device)
        self.model, self.delta, self.epochs = model, a.delta, a.epochs
        self.target_epsilon, self.accountant = a.target_epsilon, a.accountant
        self.physical_batch_size = a.physical_batch_size
        self.convention = "joint"  # k groups = one Gaussian at σ/√k (the correct charge)
        self.clipper, self.sampler, self.plan, self.dp = self._assemble(a, seed, loss)
        self.tally = Tally(Ledger())
        self.lots = Lots(self.plan, self.dp, self.tally)
        self.epoch = 0
        self.tally.budget = self._budget()
        self._data_sha256 = None

    # -- set-up ----------------------------------------------------------------------------------

    def _assemble(self, a, seed: int | None, loss):
        """The mechanism around the model (``build.assemble``, the command line's builder), σ as
        given or calibrated."""
        seed = secrets.randbits(62) if seed is None else int(seed)
        noise = GaussianNoise(
            seed=None if a.secure_rng else seed + 1, secure=a.secure_rng, device=self.device
        )
        return assemble(
            self.model,
            len(self.X),
            lot_size=a.lot_size,
            clip_norm=a.clip_norm,
            sigma=self._sigma(a),
            noise=noise,
            sampler_seed=seed,
            lr=a.lr,
            private=a.private,
            sampling=a.sampling,
            max_lot_size=a.max_lot_size,
            clipping=a.clipping,
            mode=a.mode,
            momentum=a.momentum,
            loss=loss,
            sample=(self.X[:PROOF_SAMPLE], self.y[:PROOF_SAMPLE]),  # proved on before any lot
        )

    def _sigma(self, a) -> float:
        """σ as given (checked), or calibrated for ``epochs`` at ``target_epsilon`` (then checked
        as the command line checks a calibrated σ)."""
        if not a.private:
            return 0.0
        if a.sigma is not None:
            return a.sigma
        sampler = make_sampler(a.sampling, len(self.X), a.lot_size, None, a.max_lot_size)
        lots = math.ceil(self.epochs * sampler.lots_per_epoch())
        k = len(clipping_groups(self.model, a.clipping))
        sigma = sigma_for_lots(
            sampler, self.target_epsilon, self.delta, lots, self.accountant, k, self.convention
        )
        return check_calibrated(sigma, sampler)

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
        for e in range(whole + (1 if part > 0 else 0)):
            limit = None if e < whole else round(part * self.sampler.lots_per_epoch())
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
        }

    # -- saving and loading ----------------------------------------------------------------------

    def record(self) -> dict:
        """What decides what a lot costs and which data it draws from (dpsgd/workbench/states.py):
        compared whole when a state is loaded; only ``states.MAY_CHANGE`` may differ."""
        if self._data_sha256 is None:
            self._data_sha256 = data_sha256(self.X, self.y)
        a, plan = self.args, self.plan
        return {
            "private": plan.private,
            "sigma": plan.sigma,
            "clip_norm": a.clip_norm,
            "lot_size": a.lot_size,
            "delta": a.delta,
            "sampling": a.sampling,
            "max_lot_size": a.max_lot_size,
            "accountant": self.accountant,
            "clipping": a.clipping,
            "groups": len(self.clipper.groups),
            "secure_rng": a.secure_rng,
            "N": len(self.X),
            "data_sha256": self._data_sha256,
        }

    def state_dict(self) -> dict:
        """Everything to continue exactly: the weights, the momentum, the generators, the ledger,
        and the record a state is loaded against (``record``)."""
        return {
            "model": {n: v.detach().cpu() for n, v in self.model.state_dict().items()},
            "optimizer": self.dp.state_dict(),
            "sampler": self.sampler.state_dict(),
            "noise": self.dp.noise.state_dict(),
            "ledger": self.ledger.to_dict(),
            "steps": self.steps,
            "epoch": self.epoch,
            "record": self.record(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``; the budget of the target ε is recomputed from the
        ledger. Everything is checked before anything is loaded (``states.check_state``): another
        mechanism or data, a state whose lots were not charged (σ = 0, ``private=False``, a ledger
        short of its lots), another network or generator state is refused in one line, and the
        trainer is left as it was."""
        ledger = check_state(self, state)
        before = self.state_dict()
        try:
            self._load(state, ledger)
        except Exception:  # noqa: BLE001 (checked first; whatever still fails leaves nothing)
            self._load(before, Ledger.from_dict(before["ledger"]))
            raise

    def _load(self, state: dict, ledger: Ledger) -> None:
        self.model.load_state_dict(state["model"])
        self.dp.load_state_dict(state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])
        self.dp.noise.load_state_dict(state["noise"])
        self.tally.ledger = ledger
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
