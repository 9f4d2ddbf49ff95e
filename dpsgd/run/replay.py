"""Lots lost on resume: whether a resume repeats the lots that ran after its checkpoint as the very
same releases, and the charge for those it does not.

A lot that ran after the last checkpoint may have reached an output (the write-ahead reservation,
dpsgd/run/rundir.py:LotReservations, records it before it runs). A resume either replays it as the
very same release, which costs nothing more (a seeded run, no ``privacy.secure_rng``, with the same
``replay_key``: the whole configuration but the free and length keys of
dpsgd/config/fingerprint.py:RESUME_ALLOWED, and the same runtime), or charges it now as lost, each lot
as the training loop would have charged it (``charge_lots``). ``Run.charge_lost`` and ``Run.settle``
(dpsgd/run/state.py) decide which lots; this module says why and records the charge.
"""
from __future__ import annotations

import torch

from dpsgd.config.fingerprint import config_fingerprint, replay_config
from dpsgd.config.schema import Config
from dpsgd.run.checkpoint import fingerprint_hash


def replay_key(c: Config, device: torch.device) -> dict:
    """What a seeded resume must share with the original run for its recomputed lots to be the very
    same releases (bit-identical sums): the whole configuration but the keys that change nothing a lot
    computes (``RESUME_ALLOWED``'s free and length keys), and the runtime (device, torch, threads)."""
    return {"device_type": device.type, "torch": str(torch.__version__), "threads": torch.get_num_threads(),
            **replay_config(c), "fingerprint": fingerprint_hash(config_fingerprint(c))}


def first_difference(saved: dict, current: dict) -> str | None:
    """``key: saved → current`` of the first key two replay keys differ in; None when they agree."""
    for k in [*saved, *(k for k in current if k not in saved)]:
        if saved.get(k) != current.get(k):
            return f"{k}: {saved.get(k)} → {current.get(k)}"
    return None


def lost_reason(c: Config, ckpt: dict, device: torch.device) -> str | None:
    """Why resuming ``ckpt`` with config ``c`` on ``device`` does not replay the lots after the
    checkpoint as the very same releases; None when it does (a seeded run, the same replay key)."""
    if c.privacy.secure_rng:
        return "privacy.secure_rng=true: OS-entropy noise is never replayed"
    return first_difference(ckpt["replay"], replay_key(c, device))


def charge_lots(ledger, sampler, sigma: float, k: int, first: int, n: int) -> int:
    """Record ``n`` consecutive lots as lost in ``ledger``, the first at position ``first`` of its epoch,
    each as the loop charges it (the sampler's release at its position, σ, k groups); returns n."""
    per = sampler.lots_per_epoch()
    counts: dict = {}
    for j in range(min(n, per)):       # n // per whole epochs and the rest, by position in the epoch
        charge = sampler.release(sigma, (first + j) % per)
        reps = n // per + (1 if j < n % per else 0)
        if charge is not None and reps:
            counts[charge] = counts.get(charge, 0) + reps
    for ch, reps in counts.items():
        ledger.record(ch[0], ch[1], reps, k, "lost", *ch[2:])
    return n
