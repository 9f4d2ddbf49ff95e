"""Lots lost on resume: a resume proves, lot by lot, that it repeats the releases that ran after its
checkpoint, or charges them.

A lot that ran after the last checkpoint may have reached an output. Every attempt at the run (the
first run, each resume) records, after each lot S (the lot that makes ``steps`` = S), a hash of the
parameters it produced (``digest``; dpsgd/run/rundir.py:LotReservations writes it into
``lots.reserved``, bound to the checkpoint). On resume, what an earlier attempt may have run past the
checkpoint is a ``Debt``: its lots ``first``..``upto`` (the largest of its reservations and of every
escaped output: dpsgd/run/checkpoint.py:escaped_steps) and the hashes it recorded.

A seeded resume (no ``privacy.secure_rng``) with the same ``replay_key`` is a *candidate* replay: it
owes its debts and pays them lot by lot (``Debts.prove``). Lot S costs nothing more only when the
resume's own hash after lot S equals the one every debt recorded for S (on every rank under
torchrun); at the first lot that differs, or whose hash was not recorded (the attempt died before
writing it, the line was removed), that debt's lots S..upto are charged as lost at once
(``charge_lots``). A resume that stops before a debt's last lot charges the rest (``Run.settle``).
Any other resume (another replay key, secure noise) charges every debt at once. Identity is thus
decided by the hashes, never assumed from the conditions under which it should hold; the replay key
only refuses early what cannot be identical.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import xxhash

from dpsgd.config.fingerprint import config_fingerprint, replay_config
from dpsgd.config.schema import Config
from dpsgd.mechanism.sampling import record_lots
from dpsgd.run.checkpoint import fingerprint_hash


def replay_key(c: Config, device: torch.device) -> dict:
    """What a seeded resume must share with the original run for its recomputed lots to possibly be
    the very same releases: the whole configuration but the keys that change nothing a lot computes
    (``RESUME_ALLOWED``'s free and length keys), and the runtime (device, torch, threads). Necessary,
    not sufficient: the hashes decide."""
    return {"device_type": device.type, "torch": str(torch.__version__), "threads": torch.get_num_threads(),
            **replay_config(c), "fingerprint": fingerprint_hash(config_fingerprint(c))}


def digest(model: torch.nn.Module) -> str:
    """XXH3-128 (hex) of the bytes of every parameter, in order: the state a lot released (the weights
    after its noisy update). Two runs of a lot are one release only when their digests are equal
    (bit-identical weights); a differing last bit is another release. XXH3 is not cryptographic: it
    tells apart what computations produce (another CPU's kernels, another BLAS) with a collision chance
    of about 2^-128, at ~20 GB/s (SHA-256 here: ~1.6 GB/s, 4-7 % of an MNIST step); whoever can write
    the run directory can forge a ledger anyway."""
    h = xxhash.xxh3_128()
    for p in model.parameters():
        t = p.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        h.update(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def first_difference(saved: dict, current: dict) -> str | None:
    """``key: saved → current`` of the first key two replay keys differ in; None when they agree."""
    for k in [*saved, *(k for k in current if k not in saved)]:
        if saved.get(k) != current.get(k):
            return f"{k}: {saved.get(k)} → {current.get(k)}"
    return None


def lost_reason(c: Config, ckpt: dict, device: torch.device) -> str | None:
    """Why resuming ``ckpt`` with config ``c`` on ``device`` cannot replay the lots after the
    checkpoint as the very same releases; None when it may (then the hashes decide, lot by lot)."""
    if c.privacy.secure_rng:
        return "privacy.secure_rng=true: OS-entropy noise is never replayed"
    return first_difference(ckpt["replay"], replay_key(c, device))


@dataclass
class Debt:
    """Lots ``first``..``upto`` (absolute: lot S makes ``steps`` = S) that one earlier attempt may have
    run after the checkpoint, and the parameter digest it recorded after each lot (where it did)."""
    first: int
    upto: int
    hashes: dict[int, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"first": self.first, "upto": self.upto,
                "hashes": {str(s): h for s, h in sorted(self.hashes.items()) if self.first <= s <= self.upto}}

    @classmethod
    def from_dict(cls, d: dict) -> "Debt":
        return cls(int(d["first"]), int(d["upto"]), {int(s): str(h) for s, h in d.get("hashes", {}).items()})

    @property
    def lots(self) -> int:
        return max(0, self.upto - self.first + 1)


def debts_of(binding: dict, steps: int) -> list[Debt]:
    """The debts a checkpoint carries (``reservations.debts``); a checkpoint of format 4 carries at
    most an ``owed`` count, whose lots have no recorded hashes (they can only be charged)."""
    if "debts" in binding:
        return [Debt.from_dict(d) for d in binding["debts"] or []]
    owed = int(binding.get("owed") or 0)
    return [Debt(steps + 1, owed)] if owed > steps else []


def merge(debts: list[Debt], new: Debt) -> list[Debt]:
    """``debts`` and ``new`` (the latest attempt's), whose leading lots whose digests equal another
    debt's are dropped: those runs were the very same releases (an attempt that was a faithful replay
    up to its death)."""
    while new.first <= new.upto and any(new.hashes.get(new.first) is not None
                                        and d.hashes.get(new.first) == new.hashes.get(new.first) for d in debts):
        new.first += 1
    return [*debts, new] if new.lots else list(debts)


def charge_lots(ledger, sampler, sigma: float, k: int, first: int, n: int) -> int:
    """Record ``n`` consecutive lots as lost in ``ledger``, the first at position ``first`` of its epoch,
    each as the loop charges it (``dpsgd/mechanism/sampling.py:record_lots``: the sampler's event at
    its position, σ, k groups); returns n."""
    record_lots(ledger, sampler, sigma, n, first, k, "lost")
    return n


def aligned(sampler, position: int) -> int:
    """How many lots before ``position`` (in its epoch) a lost window starting there must also cover:
    where the lot's position carries no charge of its own (one charge per epoch: shuffle, random
    allocation), the window goes back to the epoch's first lot, whose charge covers it."""
    return 0 if sampler.charged(position) else position
