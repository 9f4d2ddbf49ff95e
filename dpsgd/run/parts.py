"""The parts of a run of Algorithm 1, built once: data, projection, model, engine, step, sampler.

    data → (DP-)PCA projection → model → clipping engine → noise → DPSGD → sampler (q = L/N)

A fresh run and a resumed one build the same parts in the same order; they differ only in where the
projection and the model's weights come from (fitted and initialised from the run's seeds, or taken
from the checkpoint; see state.py) and, on resume, in the generator and optimiser states loaded
afterwards (``Parts.load_state_dict``). Nothing here writes to the run directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from dpsgd.accountant import Ledger
from dpsgd.config.optimizer import build_optimizer
from dpsgd.config.schema import Config
from dpsgd.data.augment import LotTransform, lot_generator
from dpsgd.data.datasets import dataset_info, input_shape
from dpsgd.data.files import FILE_FORMATS, load_files
from dpsgd.data.readers import load_dataset
from dpsgd.mechanism import pca
from dpsgd.mechanism.clipping import PerExampleClipper
from dpsgd.mechanism.ema import EMA
from dpsgd.mechanism.noise import GaussianNoise
from dpsgd.mechanism.optim import DPSGD
from dpsgd.mechanism.plan import Plan
from dpsgd.mechanism.sampling import Sampler
from dpsgd.models.networks import build_model, frozen_names
from dpsgd.models.pretrained import load as load_pretrained
from dpsgd.mechanism.correlated.strategy import Strategy
from dpsgd.models.trainable import fine_tune
from dpsgd.run import distributed
from dpsgd.workbench.build import PROOF_SAMPLE, assemble, planned_lots


class Instrument:
    """What an audit adds to a run (``dpsgd.audit.onerun.run``).

    Never selectable by a training config. ``data`` returns the training data with the audit's
    canaries in it (they are examples of the dataset: the sampler draws them like any other, and N,
    q and the claim count them); ``attach`` wires its observers into the built parts; ``label`` (a
    plain dict) is written into privacy.json, checkpoint.pt and metrics.csv (column ``audit``) of
    the run, so that an audit run is labelled as such everywhere it is written. The base class
    changes nothing."""

    label: dict = {}

    def data(self, data: Data) -> Data:
        return data

    def attach(self, parts: Parts) -> None:
        return None


class Data(NamedTuple):
    """The training examples the lots are drawn from and the examples evaluated on (the test set,
    or a validation split of the training set)."""

    X_train: torch.Tensor
    y_train: torch.Tensor
    X_test: torch.Tensor
    y_test: torch.Tensor


@dataclass
class Parts:
    """What a run is built from; fixed for its life (weights and generator states move, and the
    checkpoint holds them)."""

    device: torch.device
    runtime: dict  # where it runs: device, threads, versions (runtime.describe_runtime)
    data: Data  # projected, on the device
    projection: torch.Tensor | None
    model: torch.nn.Module
    clipper: PerExampleClipper
    dp: DPSGD  # clip, noise, divide by L, descend
    sampler: Sampler  # the one source of q and of the privacy event for the ledger
    transform: LotTransform  # per example: augmentation, standardisation
    ema: EMA | None = None  # EMA of the weights (training.ema_decay): the released model

    @property
    def k(self) -> int:  # separately clipped groups per lot
        return len(self.clipper.groups)

    @property
    def plan(self) -> Plan:  # the mechanism: the charged event (σ, k), C, L, the sampler
        return self.dp.plan

    @property
    def noise(self) -> GaussianNoise:
        return self.dp.noise

    def lot(self, idx: torch.Tensor, step: int, share) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Lot ``step`` (indices ``idx``) as the DP step takes it: (x, y, keywords).

        The keywords are those of ``DPSGD.step``. Padded to its fixed shape with zero-weight rows
        when the sampler pads; ``share`` cuts this rank's part (torchrun; the identity in one
        process); on the device; each example augmented from the lot's generator (the run's seed and
        ``step``), or, under augmentation multiplicity, that generator handed to the step, which
        augments the K copies of each example."""
        kw = {}
        if self.sampler.pads:  # fixed shape B: zero-weight padding rows
            idx, w = self.sampler.padded(idx)
            kw["weights"] = share(w)  # the same positions as the indices
        idx = share(idx).to(self.device)
        x, y = (
            self.data.X_train.index_select(0, idx),
            self.data.y_train.index_select(0, idx),
        )  # = [idx], 3× faster
        if self.dp.augment is not None:
            kw["generator"] = lot_generator(self.transform.seed, step)
            return x, y, kw
        return self.transform.train(x, step), y, kw

    def state_dict(self) -> dict:
        """The states that move as the run runs, under the checkpoint's keys."""
        return {
            "model": {n: v.detach().cpu() for n, v in self.model.state_dict().items()},
            "sampler": self.sampler.state_dict(),
            "noise": self.dp.noise.state_dict(),
            "optimizer": self.dp.state_dict(),
            "projection": None if self.projection is None else self.projection.cpu(),
            "ema": None if self.ema is None else self.ema.state_dict(),
        }

    def load_state_dict(self, ckpt: dict) -> None:
        """Continue from a checkpoint: the sampler's and the noise's generators, the momentum and
        the EMA (the weights are loaded before the engine is built: ``build``'s ``weights``)."""
        self.sampler.load_state_dict(ckpt["sampler"])
        self.dp.noise.load_state_dict(ckpt["noise"])
        self.dp.load_state_dict(ckpt["optimizer"])
        if (
            self.ema is not None
        ):  # training.ema_decay is in the fingerprint: the checkpoint has the EMA
            self.ema.load_state_dict(ckpt["ema"])


def load_data(c: Config) -> Data:
    """The dataset (kept at 32×32 when lots are randomly cropped), its fixed features when the model
    has them, and the validation split when tuning; on the CPU, not yet projected."""
    ds = c.dataset
    if ds.name in FILE_FORMATS:  # your own files (dataset=tensors|csv), their SHA-256 checked
        Xtr, ytr, Xte, yte = load_files(ds)
        Xtr, ytr = Xtr[: ds.subset], ytr[: ds.subset]
    else:
        Xtr, ytr, Xte, yte = load_dataset(
            ds.name,
            ds.root,
            ds.subset,
            None if ds.augment != "none" else ds.crop,
            download=ds.download,
        )
    if (
        c.model.features != "none"
    ):  # fixed per-example features (ScatterNet): no privacy cost, cached
        from dpsgd.data.archives import default_root
        from dpsgd.data.features import transform  # imports kymatio: only for models with features

        Xtr, Xte = transform(
            c.model.features,
            Xtr,
            Xte,
            dataset=ds.name,
            # the cache is keyed by the registry's archives: features of other data are not cached
            root=None if ds.name in FILE_FORMATS else Path(ds.root or default_root()),
            norm=c.model.feature_norm,
            groups=c.model.feature_groups,
        )
    if (
        ds.validation
    ):  # tuning: train on the rest, evaluate on held-out training examples (never the test set)
        n = len(Xtr) - ds.validation
        Xtr, ytr, Xte, yte = Xtr[:n], ytr[:n], Xtr[n:], ytr[n:]
    return Data(Xtr, ytr, Xte, yte)


def fit_projection(c: Config, data: Data, seed: int, ledger: Ledger) -> torch.Tensor | None:
    """The input projection of a fresh run; DP-PCA is the first release charged to ``ledger``."""
    p = c.privacy
    return pca.fit_projection(
        c.model.projection,
        data.X_train,
        c.model.pca_dims,
        p.sigma_p if p.private else 0.0,
        torch.Generator().manual_seed(seed),
        ledger if p.private else None,
        p.pca_fraction,
    )


def project(data: Data, V: torch.Tensor | None) -> Data:
    return (
        data
        if V is None
        else data._replace(X_train=pca.project(data.X_train, V), X_test=pca.project(data.X_test, V))
    )


def init_model(c: Config, data: Data, seed: int) -> torch.nn.Module:
    """The model on the CPU, initialised from its own seed (the global RNG state untouched), with
    the public pretrained weights loaded and frozen when configured (never charged), and only what
    ``model.trainable`` chooses left to train."""
    ds = c.dataset
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        shape = input_shape(ds, ds.crop) if ds.augment != "none" else tuple(data.X_train.shape[1:])
        model = build_model(c.model, shape, dataset_info(ds).classes)
        if c.model.pretrained is not None:  # frozen before the clipper is built
            load_pretrained(
                model,
                c.model.pretrained,
                c.model.pretrained_sha256,
                frozen_names(model, c.model.freeze),
            )
        m = c.model  # what fine-tuning trains (LoRA adapters drawn from the model's seed)
        fine_tune(model, m.trainable, m.lora_rank, m.lora_alpha)
    return model


def build(
    c: Config,
    d: distributed.Dist,
    device: torch.device,
    runtime: dict,
    data: Data,
    projection: torch.Tensor | None,
    model: torch.nn.Module,
    seeds: dict,
    strategy: Strategy | None = None,
) -> Parts:
    """The clipping engine, the noise, the DP-SGD step and the sampler around ``model`` (its weights
    final: initialised or loaded), with the data on ``device``. ``seeds``: the ``noise`` seed (None:
    OS entropy or privacy.noise_seed decides) and the ``sampler`` seed. ``strategy``: a resumed
    correlated-noise run's (None: optimised for the planned lots, ``horizon``)."""
    p, t, ds = c.privacy, c.training, c.dataset
    model.to(device)
    noise = GaussianNoise(seed=seeds["noise"], secure=p.secure_rng, device=device)
    transform = LotTransform(ds.augment, ds.standardize, ds.crop, c.seed)
    in_step = (
        p.augment_multiplicity > 1 and not transform.identity
    )  # the step augments the K copies
    # the mechanism, built once by the one builder the Python API uses too: the event each charge
    # records, whose σ the step noises at (charged σ = noised σ), C and L; nothing after this reads
    # σ, C or L from the configuration. check_finite=False: no device sync per physical batch; the
    # data are finite, and a non-finite loss or update stops the run as diverged (dpsgd/train.py).
    # The engine proves its structure on the first training examples as lot 0 would hold them
    # (NotPerExample, one line and exit 2 before anything is written, for a model that mixes them)
    # (negative integer labels mark an audit's special rows, which only its wrapper takes)
    ys = data.y_train
    rows = (ys >= 0).nonzero().flatten()[:PROOF_SAMPLE] if not ys.is_floating_point() else None
    x = (data.X_train[:PROOF_SAMPLE] if rows is None else data.X_train[rows]).to(device)
    y = (ys[:PROOF_SAMPLE] if rows is None else ys[rows]).to(device)
    sample = (x, y, lot_generator(transform.seed, 0)) if in_step else (transform.train(x, 0), y)
    clipper, sampler, _, dp = assemble(
        model,
        len(data.X_train),
        lot_size=p.lot_size,
        clip_norm=p.clip_norm,
        sigma=p.sigma,
        noise=noise,
        sampler_seed=seeds["sampler"],
        lr=t.lr,
        private=p.private,
        sampling=p.sampling,
        max_lot_size=p.max_lot_size,
        clipping=p.clipping,
        mode=p.grad_sample_mode,
        momentum=t.momentum,
        augment_multiplicity=p.augment_multiplicity,
        augment=transform if in_step else None,
        check_finite=False,
        sample=sample,
        # optimizer=sgd: None, DP-SGD's own update; adam, adamw, custom: a torch optimizer on the
        # trainable parameters (post-processing of the noisy gradient)
        optimizer=build_optimizer(
            c.optimizer, (w for w in model.parameters() if w.requires_grad), t.lr
        ),
        precision=t.precision,
        **_correlated(c, len(data.X_train), model, strategy),
    )
    data = Data(*(a.to(device) for a in data))
    if d.active:  # Σ over ranks, noise once; the noise is drawn in the engine's parameter order
        dp.comm = distributed.Aggregator(
            d, p.secure_rng, list(clipper.clipped_sum(data[0][:1], data[1][:1]).grads)
        )
    ema = None if t.ema_decay is None else EMA(model, t.ema_decay)
    return Parts(
        device=device,
        runtime=runtime,
        data=data,
        projection=projection,
        model=model,
        clipper=clipper,
        dp=dp,
        sampler=sampler,
        transform=transform,
        ema=ema,
    )


def _correlated(c: Config, n_examples: int, model, strategy: Strategy | None) -> dict:
    """``assemble``'s correlated-noise keywords (privacy.noise=bandmf|blt): the strategy (a resumed
    run's) or the horizon it is optimised for: training.epochs × lots per epoch, or
    training.max_steps, or the lots the target ε allows after the DP-PCA charge."""
    p, t = c.privacy, c.training
    if p.noise == "independent":
        return {}
    kw = {"noise_kind": p.noise, "bands": p.bands, "blt_buffers": p.blt_buffers}
    if strategy is not None or not p.private:
        return {**kw, "strategy": strategy}
    from dpsgd.accountant import Ledger
    from dpsgd.mechanism.clipping.groups import clipping_groups
    from dpsgd.mechanism.cyclic import make_run_sampler
    from dpsgd.mechanism.pca import charge_pca

    sampler = make_run_sampler(p.noise, p.sampling, n_examples, p.lot_size, bands=p.bands)
    lots = t.epochs * sampler.lots_per_epoch()
    lots = lots if t.max_steps is None else min(lots, t.max_steps)
    ledger = Ledger()
    if c.model.projection == "pca":
        charge_pca(ledger, p.sigma_p, p.pca_fraction)
    k = len(clipping_groups(model, p.clipping))
    horizon = planned_lots(
        sampler,
        p.sigma,
        k,
        lots,
        p.target_epsilon,
        p.delta,
        c.accountant.name,
        p.convention,
        ledger,
    )
    return {**kw, "horizon": horizon}
