"""What a ``PrivateTrainer`` state holds, and whether a trainer may continue from it: every check
made before anything is loaded (``check_state``), so that a refused state leaves the trainer as it
was.

The state records, besides the weights, momentum, generators and ledger, the trainer's
``record``: every argument that decides what a lot costs or which data it draws from (σ, C, L, δ,
the sampler, the accountant, private or not, the k groups, N and the SHA-256 of the data). As on
the command line's resume (dpsgd/config/fingerprint.py: default deny), the whole record is compared
and only ``MAY_CHANGE`` may differ, each with what changing it costs. A state whose lots were not
charged is refused by a private trainer, naming why: it ran without noise (``private=False`` or
σ = 0) or its ledger charges fewer lots than it ran. A state without a record (written before
records existed) is held to what it shows: its sampler's and noise's own fields, its ledger's
events against this trainer's charge, and the charges its lots need.
"""

from __future__ import annotations

import hashlib
import math

import torch

from dpsgd.accountant import Ledger
from dpsgd.config.fingerprint import FREE, LENGTH, REPLAY
from dpsgd.core.errors import ConfigError

KEYS = ("model", "optimizer", "sampler", "noise", "ledger", "steps", "epoch")
MAY_CHANGE = {  # arguments a state may be continued with changed, and what a change costs
    "epochs": (LENGTH, "how far fit goes; each lot that runs is charged as it runs"),
    "target_epsilon": (
        LENGTH,
        "where the stop is; each lot that runs is charged as it runs (a σ calibrated from it is "
        "compared as σ)",
    ),
    "lr": (REPLAY, "post-processing of the noisy gradients (no cost per lot), other weights"),
    "momentum": (REPLAY, "post-processing of the noisy gradients (no cost per lot), other weights"),
    "physical_batch_size": (REPLAY, "the same mechanism, sums that are not bit-identical"),
    "precision": (REPLAY, "the same mechanism, sums that are not bit-identical"),
    "optimizer": (
        REPLAY,
        "post-processing of the noisy gradients (no cost per lot): its class "
        "and parameter groups must fit the state's",
    ),
    "num_workers": (FREE, "how the examples are read; the same lots"),
    "collate_fn": (FREE, "how the examples are batched; the same lots"),
    "mode": (REPLAY, "the same mechanism, sums that are not bit-identical"),
    "seed": (FREE, "the generators continue from the state's"),
    "threads": (FREE, "how torch computes; the same mechanism"),
    "logger": (FREE, "where the rows are also sent; changes no lot"),
}


def data_sha256(*tensors: torch.Tensor) -> str:
    """SHA-256 of the training data as the trainer holds it (shapes, dtypes and bytes)."""
    h = hashlib.sha256()
    for t in tensors:
        a = t.detach().cpu().contiguous()
        h.update(f"{tuple(a.shape)}{a.dtype}".encode())
        h.update(a.view(torch.uint8).numpy().tobytes() if a.numel() else b"")
    return h.hexdigest()


def refuse(why: str) -> ConfigError:
    return ConfigError(f"load_state_dict: {why}; nothing was loaded")


def check_state(trainer, state) -> Ledger:
    """Every check of ``state`` against ``trainer`` (module doc); the state's ledger, or
    ConfigError (a ValueError) in one line. Reads the trainer, changes nothing."""
    if not isinstance(state, dict) or any(k not in state for k in KEYS):
        missing = [k for k in KEYS if not isinstance(state, dict) or k not in state]
        raise refuse(f"not a PrivateTrainer.state_dict() (no {', '.join(missing)})")
    steps, epoch = state["steps"], state["epoch"]
    for name, v in (("steps", steps), ("epoch", epoch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise refuse(f"{name}={v!r} must be an integer >= 0")
    try:
        ledger = Ledger.from_dict(state["ledger"])
    except (ValueError, TypeError) as e:
        raise refuse(f"ledger: {' '.join(str(e).split())[:200]}") from None
    record = state.get("record")
    if record is not None:
        _compare(trainer, record, steps)
    else:
        _old_state(trainer, state, ledger, steps)
    _charged(trainer, ledger, steps)
    _model(trainer, state["model"])
    _optimizer(trainer, state["optimizer"])
    _generators(trainer, state["sampler"], state["noise"])
    _epoch(trainer, state)
    return ledger


def _compare(trainer, record: dict, steps: int) -> None:
    """The state's record against the trainer's: an uncharged state named as such; then every other
    difference but MAY_CHANGE refused, naming the first."""
    mine = trainer.record()
    if not isinstance(record, dict):
        raise refuse(f"record={record!r:.80} is not a trainer's record")
    if mine["private"] and steps and not (record.get("private") and record.get("sigma")):
        why = "private=False" if not record.get("private") else "sigma=0"
        raise refuse(
            f"the state's {steps} lot(s) ran without noise ({why}) and were never charged: this "
            "private trainer's ε would not cover them (continue them with a trainer like the one "
            "that ran them, or start afresh)"
        )
    for key in [*mine, *(k for k in record if k not in mine)]:
        if key not in MAY_CHANGE and mine.get(key) != record.get(key):
            raise refuse(
                f"{key}={mine.get(key)!r} differs from the state's {key}={record.get(key)!r}; "
                "privacy-relevant arguments cannot change (those that may: "
                f"{', '.join(sorted(MAY_CHANGE))})"
            )


def _old_state(trainer, state: dict, ledger: Ledger, steps: int) -> None:
    """A state without a record: its sampler's and noise's own fields, and its ledger's events,
    against this trainer's."""
    s = state["sampler"]
    mine = trainer.sampler.state_dict()
    if not isinstance(s, dict) or any(s.get(k) != mine.get(k) for k in ("name", "N", "L", "B")):
        got = {k: s.get(k) for k in ("name", "N", "L", "B")} if isinstance(s, dict) else s
        want = {k: mine.get(k) for k in ("name", "N", "L", "B")}
        raise refuse(f"the state's sampler {got} is not this trainer's {want}")
    plan = trainer.plan
    if plan.private and steps and not ledger.entries:
        raise refuse(
            f"the state's {steps} lot(s) are not in its ledger (they ran without noise or were "
            "never charged): this private trainer's ε would not cover them"
        )
    want = None if plan.event is None else _event(plan.event.entry())
    for e in ledger.to_dict()["entries"]:
        if want is not None and _event(e) != want:
            raise refuse(
                f"the state's ledger charged {_event(e)}, this trainer charges each lot as {want}"
            )


def _event(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k not in ("count", "label")}


def _charged(trainer, ledger: Ledger, steps: int) -> None:
    """A private trainer continues only from a ledger that charges every lot its state ran: at
    least the charges ``steps`` lots need (one per lot, or per epoch: the sampler's
    ``lots_within``)."""
    plan = trainer.plan
    if not plan.private or not steps:
        return
    per_charge = plan.sampler.lots_within(1, 0)  # lots one charge covers
    need = math.ceil(steps / per_charge)
    have = sum(e.count for e in ledger.entries)
    if have < need:
        raise refuse(
            f"the state's ledger holds {have} charge(s), its {steps} lot(s) need {need}: lots ran "
            "that were not charged, and this private trainer's ε would not cover them"
        )


def _model(trainer, weights) -> None:
    own = trainer.model.state_dict()
    if not isinstance(weights, dict):
        raise refuse("model: not a state_dict")
    missing, extra = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    if missing or extra:
        raise refuse(f"model: missing {missing[:3]}, unexpected {extra[:3]} (another network)")
    for n, v in own.items():
        w = weights[n]
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != tuple(v.shape):
            shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise refuse(f"model: {n} is {shape}, this model's {tuple(v.shape)}")


def _optimizer(trainer, opt) -> None:
    params = dict(trainer.model.named_parameters())
    if not isinstance(opt, dict) or not isinstance(opt.get("velocity"), dict):
        raise refuse("optimizer: not a DPSGD state_dict")
    for n, v in opt["velocity"].items():
        if n not in params:
            raise refuse(f"optimizer: momentum of an unknown parameter {n!r}")
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(params[n].shape):
            raise refuse(f"optimizer: momentum of {n} does not fit its parameter")
    _torch_optimizer(trainer.dp.optimizer, opt.get("torch"), opt.get("torch_class"))


def _torch_optimizer(mine, theirs, cls) -> None:
    """A torch optimizer's state against this one's: the same class, parameter groups of the same
    sizes, and every per-parameter tensor of its parameter's shape."""
    name = type(mine).__name__ if mine is not None else None
    if (mine is None) != (theirs is None) or (mine is not None and cls != name):
        raise refuse(
            f"optimizer: the state's is {cls or 'the built-in SGD update'}, this one's "
            f"{name or 'the built-in SGD update'}"
        )
    if mine is None:
        return
    groups = theirs.get("param_groups") if isinstance(theirs, dict) else None
    if not isinstance(groups, list) or [len(g.get("params", ())) for g in groups] != [
        len(g["params"]) for g in mine.param_groups
    ]:
        raise refuse(f"optimizer: the state's {cls} parameter groups are not this optimizer's")
    params = [p for g in mine.param_groups for p in g["params"]]
    ids = [i for g in groups for i in g["params"]]
    for i, st in (theirs.get("state") or {}).items():
        if i not in ids or not isinstance(st, dict):
            raise refuse(f"optimizer: state of an unknown parameter {i!r}")
        p = params[ids.index(i)]
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != tuple(p.shape):
                raise refuse(f"optimizer: {cls}'s {k} of parameter {i} does not fit it")


def _epoch(trainer, state: dict) -> None:
    """Where the state's epoch stands (an engine's): a lot count within the epoch, and the
    generator state the epoch began from."""
    n, start = state.get("lot_in_epoch", 0), state.get("epoch_generator")
    per = trainer.sampler.lots_per_epoch()
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= per:
        raise refuse(f"lot_in_epoch={n!r} must be an integer in [0, {per}]")
    if n and start is not None:
        try:
            torch.Generator().set_state(start)
        except (TypeError, RuntimeError):
            raise refuse("epoch_generator: the epoch's generator state does not load") from None


def _generators(trainer, sampler, noise) -> None:
    """The sampler's and the noise's generator states load (tried on scratch generators)."""
    try:
        torch.Generator().set_state(sampler["generator"])
    except (KeyError, TypeError, RuntimeError):
        raise refuse("sampler: its generator state does not load") from None
    if not isinstance(noise, dict) or bool(noise.get("secure")) != trainer.dp.noise.secure:
        raise refuse(
            f"noise: secure_rng={bool(isinstance(noise, dict) and noise.get('secure'))} in the "
            f"state, secure_rng={trainer.dp.noise.secure} here"
        )
    if not trainer.dp.noise.secure:
        try:
            torch.Generator(device=trainer.dp.noise.generator.device).set_state(noise["state"])
        except (KeyError, TypeError, RuntimeError):
            raise refuse("noise: its generator state does not load") from None
