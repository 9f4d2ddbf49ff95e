"""``dpsgd.make_private``: DP-SGD (Abadi et al. 2016, Algorithm 1) inside your own training loop.

    engine = dpsgd.make_private(model, optimizer, dataset, lot_size=256, target_epsilon=3,
                                epochs=5, loss=my_loss)
    for lot in engine.lots():          # drawn by the sampler (q = L/N), read lazily
        engine.step(lot)               # Σ_i clip_C(g_i) + N(0, σ²C²), / L, optimizer.step(), charged
        scheduler.step()               # anything between lots: schedules, evaluation, logging
    engine.epsilon, engine.statement()

The engine is built from the objects the command line runs: the arguments through its validators
(``dpsgd/config/arguments.py``), the mechanism from its one builder (``build.assemble``: the
sampler, the clipping engine and its proof, the plan whose event each lot is charged as, the DP
step), and each lot through the lot body of Algorithm 1 (``lots.Lots``: the step and its charge held
whole against a signal). What is yours: the loop, the optimizer (any ``torch.optim.Optimizer`` on
the trainable parameters: its update is post-processing of the noisy gradient), the loss
``loss(model, batch) -> [B]`` and the data (any map-style ``Dataset``, read through a
``DataLoader``: ``reader.py``). What is not: which examples a lot holds (the sampler's), the
noise, and the charge. A step on anything but the lot ``lots()`` just yielded is refused: the
ledger accounts only for sampling the engine ran. Details: docs/API.md.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

from dpsgd.accountant import Ledger
from dpsgd.accountant.limits import DELTA_DEFAULT
from dpsgd.config.arguments import check_arguments, check_calibrated
from dpsgd.config.calibration import sigma_for_lots
from dpsgd.mechanism import batches
from dpsgd.mechanism.batches import BatchLoss
from dpsgd.mechanism.clipping.groups import clipping_groups
from dpsgd.mechanism.clipping.proof import forked_rng
from dpsgd.mechanism.correlated import strategy as strategies
from dpsgd.mechanism.cyclic import NOISES, make_run_sampler
from dpsgd.mechanism.noise import GaussianNoise
from dpsgd.workbench.build import PROOF_SAMPLE, assemble, planned_lots
from dpsgd.workbench.lots import Lots, Tally
from dpsgd.workbench.reader import Reader
from dpsgd.workbench.states import check_state


@dataclass(frozen=True, eq=False)
class Lot:
    """One lot as the sampler drew it: its ``indices`` (int64, CPU; the real examples, without a
    fixed-shape lot's padding), the ``epoch`` and the ``position`` in it. Only
    ``PrivateEngine.step`` reads its examples."""

    indices: torch.Tensor
    epoch: int
    position: int

    def __len__(self) -> int:
        return len(self.indices)


def make_private(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset,
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
    seed: int | None = None,
    secure_rng: bool = False,
    physical_batch_size: int | None = None,
    num_workers: int = 0,
    collate_fn=None,
    precision: str = "fp32",
    clipping: str = "global",
    mode: str = "auto",
    allow_large_delta: bool = False,
    private: bool = True,
    noise: str = "independent",
    bands: int | None = None,
    blt_buffers: int = 4,
) -> PrivateEngine:
    """A ``PrivateEngine`` for your loop (module doc).

    Args:
        model: the network (its trainable parameters, ``requires_grad``, are clipped, noised and
            updated; frozen ones never move). A layer or forward pass that mixes examples is
            refused (the clipper's proof on the first examples).
        optimizer: any ``torch.optim.Optimizer`` over the model's trainable parameters (SGD,
            Adam, AdamW, ...): it gets the noisy mean gradient in ``.grad``.
        dataset: a map-style ``Dataset``; each example a tensor or a tuple/list/dict of tensors.
        lot_size: L, the expected lot size (q = L/N for Poisson); the noisy sum is divided by L.
        clip_norm: C.
        sigma: σ (noise std σC); or ``target_epsilon`` and ``epochs`` to calibrate it.
        target_epsilon: ``lots()`` stops before the lot that would spend more (with ``sigma``),
            or σ is calibrated so that ``epochs`` spend it (without).
        epochs: the horizon of ``lots()`` (ceil(epochs · lots per epoch) lots in all) and of the
            calibration; None: until the target ε (or forever: your loop stops).
        delta: δ, below 1/N unless ``allow_large_delta``.
        sampling: ``poisson``, ``fixed_size``, ``truncated_poisson`` (``max_lot_size``),
            ``balls_in_bins`` or ``shuffle``, each charged by its own analysis.
        accountant: of ε and the stop; None: the tightest valid one for the sampler (PLD).
        loss: ``loss(model, batch) -> [B]``, one loss per example, calling the model as it wants
            (``model(**batch).logits``; ``dpsgd.mechanism.batches.token_losses`` averages token
            losses per example over a padding mask). None: batches are ``(x, y)`` and the loss is
            the cross-entropy of ``model(x)`` (or its ``.logits``) against ``y``.
        seed: the sampler's and the noise's seeds (None: from the OS).
        secure_rng: the noise from OS entropy (no seed).
        physical_batch_size: the most examples per forward/backward pass (memory only).
        num_workers, collate_fn: the DataLoader's that reads the lots.
        precision: ``fp32`` or ``bf16`` (forward and backward under autocast; norms, clip
            factors, sums and noise in float32).
        clipping, mode: ``global`` or ``per_layer``; the engine ``auto``, ``ghost`` or ``vmap``.
        allow_large_delta: accept δ >= 1/N.
        private: False: the same loop without clipping, noise or charge (a baseline; ε = ∞).
        noise: ``independent`` (Algorithm 1), ``bandmf`` or ``blt``: correlated noise (DP matrix
            factorisation, docs/CORRELATED_NOISE.md) under its cyclic participation (``sampling=
            "poisson"`` becomes cyclic_poisson for BandMF, cyclic for BLT); its strategy is
            optimised for the lots ``epochs`` (or the target ε) plan.
        bands, blt_buffers: b of BandMF (1: Algorithm 1's noise), at most d buffers of BLT.

    Raises:
        ValueError: one line naming the argument (the command line's refusal, in the API's words).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"optimizer={type(optimizer).__name__}: give a torch.optim.Optimizer over the model's "
            "trainable parameters (torch.optim.SGD(params, lr) is DP-SGD)"
        )
    kw = {k: v for k, v in locals().items() if k not in ("model", "optimizer", "dataset")}
    return PrivateEngine(model, dataset, optimizer=optimizer, **kw)


class PrivateEngine:
    """DP-SGD in a loop you write (``make_private``, whose arguments these are; ``PrivateTrainer``
    runs its own loop over one). ``optimizer`` None: the built-in SGD update (``lr``, heavy-ball
    ``momentum``), as the command line's ``optimizer=sgd``. ``pair_loss``: a
    ``loss(output, target) -> [B]`` on ``(x, y)`` batches (``PrivateTrainer``'s)."""

    def __init__(self, model, dataset, *, optimizer=None, loss=None, pair_loss=None, seed=None,
                 lr=None, momentum=0.0, private=True, num_workers=0, collate_fn=None,
                 precision="fp32", noise="independent", bands=None, blt_buffers=4,
                 **kw):  # fmt: skip
        if noise not in NOISES:
            raise ValueError(f"noise={noise!r}: one of {', '.join(NOISES)}")
        self.correlated = {"noise_kind": noise, "bands": bands, "blt_buffers": blt_buffers}
        self.model = model
        self.device = next(model.parameters()).device
        self.reader = Reader(dataset, self.device, kw.get("physical_batch_size"), num_workers,
                             collate_fn)  # fmt: skip
        step_lr = lr if optimizer is None else _lr(optimizer)
        a = check_arguments(
            self.reader.N, lr=step_lr, momentum=momentum, private=private, seed=seed,
            precision=precision, **kw,
        )  # fmt: skip
        self.reader.physical_batch_size = a.physical_batch_size  # as checked
        self.args, self.optimizer, self.precision = a, optimizer, a.precision
        self.delta, self.epochs, self.accountant = a.delta, a.epochs, a.accountant
        self.target_epsilon, self.convention = a.target_epsilon, "joint"  # k groups: σ/√k
        self.pairs = loss is None  # batches (x, y): cross-entropy, or pair_loss(output, target)
        if loss is not None and pair_loss is not None:
            raise ValueError("give loss(model, batch) or a pair loss, not both")
        clip_loss = pair_loss if self.pairs else BatchLoss(loss)
        self.clipper, self.sampler, self.plan, self.dp = self._assemble(a, seed, clip_loss)
        self.tally = Tally(Ledger())
        self.lots_body = Lots(self.plan, self.dp, self.tally)
        self.epoch, self.stop_reason = 0, None
        self._iter, self._position, self._epoch_state, self._pending = None, 0, None, None
        self.tally.budget = self._budget()
        self._sha256 = False  # not yet computed (None: a lazy dataset, not hashed)

    # -- set-up ----------------------------------------------------------------------------------

    def _assemble(self, a, seed, clip_loss):
        """The mechanism (``build.assemble``, the command line's builder), σ as given or
        calibrated, proved on the first examples before any lot."""
        seed = secrets.randbits(62) if seed is None else int(seed)
        noise = GaussianNoise(
            seed=None if a.secure_rng else seed + 1, secure=a.secure_rng, device=self.device
        )
        first = self.reader.first(PROOF_SAMPLE)
        sigma = self._sigma(a)
        return assemble(
            self.model,
            self.reader.N,
            lot_size=a.lot_size,
            clip_norm=a.clip_norm,
            sigma=sigma,
            horizon=self._horizon(a, sigma),
            **self.correlated,
            noise=noise,
            sampler_seed=seed,
            lr=a.lr,
            private=a.private,
            sampling=a.sampling,
            max_lot_size=a.max_lot_size,
            clipping=a.clipping,
            mode=a.mode,
            momentum=a.momentum,
            loss=clip_loss,
            sample=self._parts_of(first),
            optimizer=self.optimizer,
            precision=a.precision,
        )

    def _sigma(self, a) -> float:
        """σ as given, or calibrated for ``epochs`` at ``target_epsilon`` (then checked as the
        command line checks a calibrated σ)."""
        if not a.private:
            return 0.0
        if a.sigma is not None:
            return a.sigma
        sampler = self._sampler(a)
        lots = math.ceil(self.epochs * sampler.lots_per_epoch())
        k = len(clipping_groups(self.model, a.clipping))
        sigma = sigma_for_lots(
            sampler, self.target_epsilon, self.delta, lots, self.accountant, k, self.convention
        )
        return check_calibrated(sigma, sampler)

    def _sampler(self, a):
        """A sampler like the run's (its lots per epoch, its charges), for the set-up's searches:
        the cyclic one correlated noise runs under (``cyclic.make_run_sampler``)."""
        c = self.correlated
        return make_run_sampler(
            c["noise_kind"], a.sampling, self.reader.N, a.lot_size, None, a.max_lot_size, c["bands"]
        )

    def _horizon(self, a, sigma: float) -> int | None:
        """The lots a correlated-noise strategy is optimised for: ``epochs`` of lots, fewer where
        the target ε stops first (``build.planned_lots``); None without correlated noise."""
        kind = self.correlated["noise_kind"]
        if kind == "independent" or not (a.private and sigma > 0):
            return None
        if self.epochs is None and self.target_epsilon is None:
            raise ValueError(
                f"noise={kind!r}: give epochs (or target_epsilon), the horizon its strategy is "
                "optimised for"
            )
        sampler = self._sampler(a)
        k = len(clipping_groups(self.model, a.clipping))
        lots = math.ceil(self.epochs * sampler.lots_per_epoch()) if self.epochs else 10**7
        name = self.accountant or sampler.accountants[0]
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

    def _parts_of(self, batch):
        """A physical batch as the clipper takes it: (x, y) of a pair, or (batch, None)."""
        if not self.pairs:
            return batch, None
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ValueError(
                "loss=None reads (x, y) examples (cross-entropy of model(x) against y); give "
                "loss(model, batch) -> [B] for batches of another form"
            )
        return batch[0], batch[1]

    # -- the loop --------------------------------------------------------------------------------

    def lots(self):
        """The lots of training, each drawn by the sampler when asked for, until the horizon
        (``epochs``) or before the lot that would pass the target ε (``stop_reason`` says which).
        Every lot is to be stepped (``step``) before the next is drawn; one not stepped when the
        loop breaks is the first of the next call."""
        horizon = None if self.epochs is None else math.ceil(self.epochs * self._per_epoch())
        yield from self._lots(lambda: horizon is not None and self.tally.steps >= horizon)

    def _lots(self, done, epoch_end: bool = False):
        """Lots until ``done()`` (then stop_reason ``epochs_completed``), the target ε, or with
        ``epoch_end`` the end of the current epoch."""
        first_epoch = self.epoch
        while True:
            if done() or (epoch_end and self.epoch > first_epoch):
                self.stop_reason = "epochs_completed"
                return
            left = self.lots_body.left(self._position if self._iter is not None else 0)
            if self._pending is None and left is not None and left <= 0:
                self.stop_reason = "target_epsilon_reached"
                return
            lot = self._draw()
            yield lot
            if self._pending is lot:
                raise RuntimeError(
                    f"engine.lots(): lot {lot.position} of epoch {lot.epoch} was drawn and not "
                    "stepped; call engine.step(lot) on every lot before asking for the next"
                )

    def _per_epoch(self) -> int:
        return self.sampler.lots_per_epoch()

    def _end_epoch(self) -> None:
        """The sampler's epoch run to its end (a cyclic sampler counts its last lot only then, as
        the command line's loop over the whole epoch does), and the next epoch begun."""
        next(self._iter, None)
        self._iter, self.epoch = None, self.epoch + 1

    def _draw(self) -> Lot:
        """The lot not yet stepped, or the next lot of the current epoch (one is begun when none
        runs): drawn by the sampler, from its generator."""
        if self._pending is not None:
            return self._pending
        if self._iter is not None and self._position >= self._per_epoch():
            self._end_epoch()  # its last lot drawn, never stepped
        if self._iter is None:
            self._epoch_state = self.sampler.generator.get_state()
            self._iter, self._position = self.sampler.epoch(), 0
        idx = next(self._iter)
        self._pending = Lot(idx, self.epoch, self._position)
        self._position += 1
        return self._pending

    def step(self, lot: Lot) -> dict:
        """Lot ``lot`` (the one ``lots()`` just yielded): each example's gradient clipped to C,
        the noise N(0, σ²C²) added once to the sum, the noisy mean (sum / expected L) into
        ``.grad`` and ``optimizer.step()``; the lot charged to the ledger, held together with the
        step against a signal (a step that raises after it began to move the weights is charged
        all the same). Returns {'loss_sum' (a 0-dim tensor), 'lot_size' (its examples)}."""
        if lot is None or lot is not self._pending:
            raise ValueError(
                "engine.step: this lot did not come from engine.lots() (or was stepped already); "
                "the ledger accounts only for lots the engine's sampler drew"
            )
        idx, weights = lot.indices, None
        if self.sampler.pads:  # fixed-shape lots: zero-weight padding rows
            idx, weights = self.sampler.padded(idx)

        def run():
            parts = (
                (*self._parts_of(b), {} if w is None else {"weights": w.to(self.device)})
                for b, w in self.reader.batches(idx, weights)
            )
            total, loss_sum, n = self.dp.noisy_sum(parts, len(lot), self.device)
            self.dp.update(total)
            return {"loss_sum": loss_sum, "lot_size": n}

        out = self.lots_body.held(lot.position, run)
        self._pending = None
        if self._position >= self._per_epoch():  # the epoch's last lot: the epoch is complete
            self._end_epoch()
        return out

    # -- what it has spent -----------------------------------------------------------------------

    @property
    def ledger(self) -> Ledger:
        return self.tally.ledger

    @property
    def steps(self) -> int:
        """Lots stepped (and charged)."""
        return self.tally.steps

    @property
    def epsilon(self) -> float:
        """ε at δ of every lot stepped so far (∞ when not private: nothing bounds it)."""
        if not self.plan.private:
            return math.inf
        return float(self.ledger.epsilon(self.delta, self.accountant, self.convention)[0])

    def _epsilon_by(self, accountant: str) -> float | None:
        try:
            return float(self.ledger.epsilon(self.delta, accountant, self.convention)[0])
        except ValueError:
            return None

    def statement(self) -> dict:
        """What was spent and how it was charged, with ε under every accountant that serves it."""
        s, plan = self.sampler, self.plan
        return {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "accountant": self.accountant,
            "epsilon_by_accountant": {a: self._epsilon_by(a) for a in plan.accountants},
            "private": plan.private,
            "steps": self.steps,
            "epochs": self.epoch,
            "sampling": {"name": s.name, "N": self.reader.N, "L": plan.lot_size, "q": s.q},
            "sigma": plan.sigma,
            "clip_norm": plan.clip_norm,
            "groups": plan.groups,
            "adjacency": plan.adjacency,
            "precision": self.precision,
            "optimizer": type(self.optimizer).__name__ if self.optimizer else "DPSGD (built-in)",
            "ledger": self.ledger.to_dict(),
            **self._correlated_statement(),
        }

    def _correlated_statement(self) -> dict:
        """The correlated noise's strategy and its noise per step (none for Algorithm 1's)."""
        s = self.plan.strategy
        if s is None:
            return {}
        return {
            "correlated_noise": {
                "strategy": s.to_dict(),
                "noise_multiplier_per_step": strategies.noise_multiplier_per_step(s),
                "expected_error_ratio": strategies.expected_error_ratio(s),
            }
        }

    def per_example_norms(self, batch) -> torch.Tensor:
        """Each example's gradient norm before clipping ([B, k]: per clipping group), for checks:
        nothing is updated, noised or charged, the RNG is untouched. These are functions of
        private examples, not covered by ε: look at them on data you may see."""
        batch = batches.to_device(batch, self.device)
        x, y = self._parts_of(batch)
        with forked_rng(self.device):
            return self.clipper.clipped_sum(x, y).norms

    # -- saving and loading ----------------------------------------------------------------------

    def record(self) -> dict:
        """What decides what a lot costs and which data it draws from (dpsgd/workbench/states.py):
        compared whole when a state is loaded; only ``states.MAY_CHANGE`` may differ."""
        if self._sha256 is False:
            self._sha256 = self.reader.sha256()
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
            "N": self.reader.N,
            "data_sha256": self._sha256,
            **({} if self.correlated["noise_kind"] == "independent" else dict(self.correlated)),
        }

    def state_dict(self) -> dict:
        """Everything to continue exactly: the weights, the optimizer, the generators (and where
        the current epoch's lots stand), the ledger, and the record a state is loaded against; a
        snapshot (copies, on the CPU), which training on does not change."""
        return {
            "model": {
                n: v.detach().to("cpu", copy=True) for n, v in self.model.state_dict().items()
            },
            "optimizer": self.dp.state_dict(),
            "sampler": self.sampler.state_dict(),
            "noise": self.dp.noise.state_dict(),
            "ledger": self.ledger.to_dict(),
            "steps": self.steps,
            "epoch": self.epoch,
            "lot_in_epoch": self._position if self._iter is not None else 0,
            "epoch_generator": self._epoch_state if self._iter is not None else None,
            "record": self.record(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``; the budget of the target ε is recomputed from the
        ledger. Everything is checked before anything is loaded (``states.check_state``): another
        mechanism or data, a state whose lots were not charged, another network, optimizer or
        generator state is refused in one line, and the engine is left as it was."""
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
        self._iter, self._position, self._pending, self._epoch_state = None, 0, None, None
        position, start = state.get("lot_in_epoch", 0), state.get("epoch_generator")
        if position and start is not None:  # mid-epoch: the epoch's lots drawn again, the same
            if hasattr(self.sampler, "position"):  # a cyclic sampler's count: back to the epoch's
                self.sampler.position -= position - 1  # start (its last lot counts when left)
            now = self.sampler.generator.get_state()
            self.sampler.generator.set_state(start)
            self._epoch_state, self._iter = start, self.sampler.epoch()
            for _ in range(position):
                next(self._iter)
            self._position = position
            if not torch.equal(self.sampler.generator.get_state(), now):
                raise ValueError("load_state_dict: the state's epoch does not replay to its lots")


def _lr(optimizer) -> float:
    """The first parameter group's learning rate (checked like training.lr)."""
    lr = optimizer.param_groups[0].get("lr", 0.1) if optimizer.param_groups else 0.1
    return float(lr)
