"""``dpsgd.PrivateTrainer``: DP-SGD (Abadi et al. 2016, Algorithm 1) on your own model and data.

A thin loop over the engine of ``dpsgd.make_private`` (``engine.PrivateEngine``): it holds the
data in memory as two tensors, and runs epochs of the engine's lots, each through the engine's step
(the mechanism of ``build.assemble``, the command line's builder; the lot body ``lots.Lots``, its
charge held whole), so each lot is charged as it runs and nothing can be forgotten. Details and
examples: docs/API.md.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from dpsgd.accountant import Ledger
from dpsgd.accountant.limits import DELTA_DEFAULT
from dpsgd.core.runtime import configure_threads
from dpsgd.workbench.engine import PrivateEngine
from dpsgd.workbench.sources import as_tensors


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
        accountant: the accountant of ``epsilon`` and of the stop; None: the tightest valid one
            for the sampler (PLD: ``dpsgd/config/privacy.py:tightest``).
        loss: ``loss(output, target) -> [B]``, one value per example (``reduction="none"``); None:
            cross-entropy (of the output, or of its ``.logits``).
        lr, momentum: the built-in update θ ← θ − η g̃ (with momentum μ: heavy ball on g̃).
        optimizer: any ``torch.optim.Optimizer`` over the model's trainable parameters instead
            (Adam, AdamW, ...): it gets g̃ in ``.grad`` (post-processing: no privacy cost).
        clipping, mode: ``global`` or ``per_layer``; the engine ``auto``, ``ghost`` or ``vmap``.
        physical_batch_size: the most examples per forward pass (None: the whole lot).
        precision: ``fp32`` or ``bf16`` (forward and backward under autocast; the norms, clip
            factors, sums and noise in float32).
        private: False runs the same loop with a plain step (one backward pass of the summed loss,
            divided by L; no per-example work, clipping, noise or charge; ε = ∞).
        seed: the sampler's and the noise's seeds (None: drawn from the OS).
        secure_rng: draw the noise from OS entropy (a seed is then refused).
        allow_large_delta: accept δ >= 1/N (``privacy.allow_large_delta``).
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
        optimizer: torch.optim.Optimizer | None = None,
        clipping: str = "global",
        mode: str = "auto",
        physical_batch_size: int | None = None,
        precision: str = "fp32",
        private: bool = True,
        seed: int | None = None,
        secure_rng: bool = False,
        threads: int | bool | None = None,
        logger=None,
        allow_large_delta: bool = False,
        noise: str = "independent",
        bands: int | None = None,
        blt_buffers: int = 4,
    ):
        kw = {k: v for k, v in locals().items() if k not in ("self", "model", "data", "threads")}
        kw.pop("logger")
        X, y = as_tensors(data)
        device = next(model.parameters()).device
        self.X, self.y = X.to(device), y.to(device)
        kw["pair_loss"] = kw.pop("loss")
        self.engine = PrivateEngine(model, TensorDataset(self.X, self.y), **kw)
        e = self.engine
        self.args, self.threads, self.logger = e.args, _threads(threads), logger
        self.model, self.device, self.delta, self.epochs = model, device, e.delta, e.epochs
        self.target_epsilon, self.accountant = e.target_epsilon, e.accountant
        self.physical_batch_size, self.convention = e.args.physical_batch_size, e.convention
        self.clipper, self.sampler, self.plan, self.dp = e.clipper, e.sampler, e.plan, e.dp
        self.last_loss = None

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
        """The rest of the current epoch of lots (the first ``max_lots`` of them);
        ``target_epsilon_reached`` when the target ε stopped it before its end, else None. The
        mean loss per example is on ``self.last_loss``. Each lot goes through the engine's step
        (``engine.PrivateEngine.step``: the DP step and its charge, held whole)."""
        loss, seen, ran = 0.0, 0, [0]
        e = self.engine
        for lot in e._lots(lambda: max_lots is not None and ran[0] >= max_lots, epoch_end=True):
            out = e.step(lot)
            ran[0] += 1
            loss, seen = loss + float(out["loss_sum"]), seen + int(out["lot_size"])
        self.last_loss = loss / max(1, seen)
        if e.stop_reason == "target_epsilon_reached":
            return "target_epsilon_reached"
        if self.logger is not None:  # one row per epoch run, the epoch its step
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

    # -- what it has spent (the engine's) --------------------------------------------------------

    @property
    def tally(self):
        return self.engine.tally

    @property
    def lots(self):
        return self.engine.lots_body

    @property
    def epoch(self) -> int:
        """Epochs of the sampler completed."""
        return self.engine.epoch

    @property
    def ledger(self) -> Ledger:
        return self.engine.ledger

    @property
    def steps(self) -> int:
        """Lots run."""
        return self.engine.steps

    @property
    def epsilon(self) -> float:
        """ε at δ of every lot run so far (∞ when not private: nothing bounds it)."""
        return self.engine.epsilon

    def statement(self) -> dict:
        """What was spent and how it was charged, with ε under every accountant that serves it."""
        return self.engine.statement()

    # -- saving and loading ----------------------------------------------------------------------

    def record(self) -> dict:
        """What decides what a lot costs and which data it draws from (dpsgd/workbench/states.py):
        compared whole when a state is loaded; only ``states.MAY_CHANGE`` may differ."""
        return self.engine.record()

    def state_dict(self) -> dict:
        """Everything to continue exactly: the weights, the optimizer, the generators, the ledger,
        and the record a state is loaded against (``record``)."""
        return self.engine.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``; the budget of the target ε is recomputed from the
        ledger. Everything is checked before anything is loaded (``states.check_state``): another
        mechanism or data, a state whose lots were not charged (σ = 0, ``private=False``, a ledger
        short of its lots), another network or generator state is refused in one line, and the
        trainer is left as it was."""
        self.engine.load_state_dict(state)


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
