"""Data-parallel DP-SGD over torch.distributed: ``torchrun --nproc_per_node=P -m dpsgd.train ...``.

The mechanism is the one of one process (Abadi et al. 2016, Algorithm 1), computed by P processes:
every rank runs the same seeded Poisson sampler over the *whole* training set and takes the share
``lot[r::P]`` of the one global lot; ONE all-reduce (sum) per lot carries the k clipped sums, Σ loss
and the lot size; N(0, σ²C²) is added **exactly once** to the global sum (seeded: the identical draw
on every rank after the all-reduce; ``privacy.secure_rng``: rank 0's draw, added before it), then
divided by the expected global L, so parameters stay identical on every rank.

Only rank 0 writes (metrics.csv, privacy.json, checkpoints, lot reservations) and holds the run
lock. Before the first lot every rank agrees on the whole run (``agree_on``: ``config_items``, every
key but those in ``PER_RANK``, then ``state_items``); a difference stops every rank with the same
line (``RanksDisagree``, exit 2) before anything is written.

The command line under torchrun (one run directory agreed by every rank) is
``dpsgd/launch/main.py:torchrun_main``; this module is the communication only.

Details: docs/SCALING.md, "dpsgd/run/distributed.py".
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import time
from dataclasses import dataclass

import torch

from dpsgd.core.errors import ConfigError, one_line

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class Dist:
    """Where this process sits in the run: rank, world size, local rank, process-group backend."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None  # None: one process, no process group

    @property
    def active(self) -> bool:
        return self.backend is not None

    @property
    def writes(self) -> bool:  # the one writer of the run directory
        return self.rank == 0

    def share(self, idx: torch.Tensor) -> torch.Tensor:
        """This rank's deterministic share of a global lot: every P-th index from position rank."""
        return idx[self.rank :: self.world_size] if self.world_size > 1 else idx

    def describe(self, device: torch.device | None = None) -> dict:
        """For privacy.json and the checkpoint: world size and the backend of the gradient
        all-reduce."""
        if not self.active:
            return {"world_size": 1, "backend": None}
        cuda = device is not None and torch.device(device).type == "cuda"
        return {"world_size": self.world_size, "backend": "nccl" if cuda else "gloo"}


_CURRENT = Dist()


def current() -> Dist:
    return _CURRENT


def from_env(env=None) -> Dist | None:
    """The Dist torchrun describes in RANK / WORLD_SIZE / LOCAL_RANK, None outside torchrun."""
    env = os.environ if env is None else env
    if not all(k in env for k in ENV[:2]):
        return None
    try:
        rank, world, local = (int(env.get(k, "0")) for k in ENV)
    except ValueError:
        raise ConfigError(
            f"{', '.join(ENV)}={[env.get(k) for k in ENV]}: must be integers (set by torchrun)"
        ) from None
    if not (world >= 1 and 0 <= rank < world and local >= 0):
        raise ConfigError(f"RANK={rank}, WORLD_SIZE={world}: need 0 <= RANK < WORLD_SIZE")
    return Dist(rank, world, local, "?")


def init(d: Dist, init_method: str = "env://", cuda: bool | None = None) -> Dist:
    """Join the process group (gloo for CPU tensors; with CUDA also nccl for CUDA tensors, device
    cuda:LOCAL_RANK) and make ``d`` the current context. ``cuda=False``: CPU only (forked test
    ranks)."""
    import torch.distributed as td

    global _CURRENT
    cuda = torch.cuda.is_available() if cuda is None else cuda
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(d.local_rank % torch.cuda.device_count())
    if not td.is_initialized():
        td.init_process_group(
            backend, init_method=init_method, rank=d.rank, world_size=d.world_size
        )
    _CURRENT = Dist(d.rank, d.world_size, d.local_rank, backend)
    _reset_exchanges()
    return _CURRENT


def _reset_exchanges() -> None:
    global _exchanges
    _exchanges = 0


def shutdown() -> None:
    import torch.distributed as td

    global _CURRENT
    if td.is_initialized():
        td.destroy_process_group()
    _CURRENT = Dist()
    _reset_exchanges()


class PeerLost(OSError):
    """A collective failed: another process of the run stopped (exit 1, one line)."""


def _collective(fn, *a, **kw):
    try:
        return fn(*a, **kw)
    except RuntimeError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise PeerLost(
            f"distributed rank {_CURRENT.rank}: a collective failed ({first}); another process "
            "of this run stopped — resume from the last checkpoint with the same torchrun command "
            "and resume=<run dir>"
        ) from None


def broadcast_object(obj):
    """Rank 0's ``obj`` (picklable) on every rank, through CPU tensors (gloo); ``obj`` in one
    process."""
    d = _CURRENT
    if not d.active:
        return obj
    import torch.distributed as td

    data = pickle.dumps(obj) if d.rank == 0 else b""
    n = torch.tensor([len(data)], dtype=torch.int64)
    _collective(td.broadcast, n, src=0)
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if d.rank == 0
        else torch.empty(int(n), dtype=torch.uint8)
    )
    _collective(td.broadcast, buf, src=0)
    return pickle.loads(buf.numpy().tobytes()) if d.rank != 0 else obj


class PeerRefused(ConfigError):
    """Another rank refused the run (its own line says why); this rank exits 2 quietly."""


def agree(err: BaseException | None) -> None:
    """A barrier that also agrees on failure: re-raise ``err`` here, or PeerRefused (naming the
    first rank that failed, with its line) when another rank failed. Every rank must reach it (setup
    reads before it and writes after it)."""
    if _CURRENT.active:
        lines = all_gather_bytes(b"" if err is None else one_line(err).encode())
        failed = next(((r, line.decode()) for r, line in enumerate(lines) if line), None)
        if err is None and failed is not None:
            raise PeerRefused(f"rank {failed[0]} refused the run: {failed[1]}")
    if err is not None:
        raise err


class RanksDisagree(ConfigError):
    """The ranks were started on different runs (or one could not start): the same line on every
    rank."""


# Config keys that may differ between ranks, each a place where a node finds something whose content
# is compared anyway (``state_items``: the data every rank loaded, the weights it built). Every
# other key of the validated Config is compared: a key added to the schema is compared without a
# change here.
PER_RANK = frozenset(
    {
        # this node's data folder (None: $DPSGD_DATA_ROOT); the data is compared by hash
        "dataset.root",
        # whether this node may fetch a missing copy; the data is compared by hash
        "dataset.download",
        # the artifact's path on this node; model.pretrained_sha256 and the weights are compared
        "model.pretrained",
    }
)
SAME_BUILD = (
    "; every rank must read the same data and checkpoint and build the same run "
    "(the same hardware and software)"
)
REFUSED = "refused"  # the one item of a rank that could not build its run (its one-line error)
_MISSING = "(no such key)"
_exchanges = 0  # agree_on calls of this process group; a refusal joins only the first


def canonical(items: dict) -> dict[str, str]:
    """``items`` as the texts every rank compares (JSON; tensors by dtype, shape and the SHA-256 of
    their bytes, so two ranks agree only on bit-identical values); a refusal's line is kept as it
    is."""
    return {k: v if k == REFUSED else _canonical(v) for k, v in items.items()}


def _canonical(value) -> str:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        digest = hashlib.sha256(
            t.reshape(-1).view(torch.uint8).numpy()
        ).hexdigest()  # no copy of the bytes
        return f"tensor {str(t.dtype).removeprefix('torch.')}{list(t.shape)} sha256 {digest}"
    return json.dumps(value, sort_keys=True, default=str)


def flat_items(tree, prefix: str = "") -> dict:
    """{dotted key: leaf} of nested dicts (lists, tensors and scalars are leaves), in insertion
    order."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for k, v in tree.items():
        out.update(flat_items(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def config_items(c) -> dict:
    """What every rank must share before it reads anything: every key of the validated Config (the
    resolved values: a calibrated σ, a filled-in pretrained_sha256) but ``PER_RANK``.

    The command lines themselves are not compared: the validated Config is the whole run (the typed
    schema refuses any key outside it; Hydra's own settings, such as the run folder, are agreed
    before, by ``broadcast_object``), and only rank 0's overrides are recorded. So
    ``privacy.sigma=4`` on one rank and ``privacy.sigma=4.0`` or the same overrides in another order
    on another agree, while any difference in what the run does is named by its key."""
    return {k: v for k, v in flat_items(c.to_dict()).items() if k not in PER_RANK}


def state_items(data: dict, state: dict, progress: dict) -> dict:
    """What every rank must have read and built before the first lot: the data as the lots see it
    (after features and projection), the parameters and generator states (initialised or restored
    from the checkpoint), the projection, and the progress (ledger, epoch, lots)."""
    return flat_items({"data": data, "state": state, "progress": progress})


def _show(text: str) -> str:
    if text.startswith("tensor "):  # its dtype, shape and the digest's first digits
        head, digest = text.split(" sha256 ", 1)
        return f"{head} sha256 {digest[:12]}…"
    return text if len(text) <= 80 else text[:77] + "…"


def first_difference(every: list[dict]) -> str | None:
    """The line naming the first item (in rank 0's order) on which a rank differs from rank 0, or
    the first rank that refused; None when every rank holds the same items (``every[r]``: rank
    r's)."""
    for r, items in enumerate(every):
        if REFUSED in items:
            return items[REFUSED] if r == 0 else f"rank {r}: {items[REFUSED]}"
    keys = dict.fromkeys(
        k for items in every for k in items
    )  # rank 0's keys first, then any others
    for k in keys:
        ref = every[0].get(k, _MISSING)
        for r in range(1, len(every)):
            mine = every[r].get(k, _MISSING)
            if mine != ref:
                return f"ranks disagree on {k}: rank 0 has {_show(ref)}, rank {r} has {_show(mine)}"
    return None


def all_gather_bytes(data: bytes) -> list[bytes]:
    """Every rank's ``data``, in rank order, on every rank (CPU tensors: gloo); [data] in one
    process."""
    d = _CURRENT
    if not d.active:
        return [data]
    import torch.distributed as td

    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(d.world_size)]
    _collective(td.all_gather, sizes, torch.tensor([len(data)], dtype=torch.int64))
    n = max(int(s) for s in sizes)
    mine = torch.zeros(n, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty(n, dtype=torch.uint8) for _ in range(d.world_size)]
    _collective(td.all_gather, bufs, mine)
    return [b[: int(s)].numpy().tobytes() for b, s in zip(bufs, sizes)]


def agree_on(items: dict, hint: str = "") -> None:
    """Every rank gathers every rank's ``items`` and compares them with rank 0's: on any difference
    all raise ``RanksDisagree`` with the same line naming the first differing key (and ``hint``).
    Every rank must call it at the same point; a no-op in one process."""
    global _exchanges
    if not _CURRENT.active:
        return
    mine = json.dumps(canonical(items)).encode()
    every = [json.loads(b) for b in all_gather_bytes(mine)]
    _exchanges += 1
    msg = first_difference(every)
    if msg is not None:
        raise RanksDisagree(msg + (hint if msg.startswith("ranks disagree") else ""))


def join_refusal(err: ConfigError) -> None:
    """A rank that cannot build its run before the configuration is agreed (an override refused on
    one node only, data missing there) joins that exchange with its one line, so every rank stops
    with it instead of waiting for this one; re-raises ``err`` when the exchange is already past."""
    if _CURRENT.active and _exchanges == 0 and not isinstance(err, (RanksDisagree, PeerRefused)):
        agree_on({REFUSED: one_line(err)})
    raise err


class Aggregator:
    """Σ over ranks of the clipped sums, with the noise added exactly once (see the module doc).

    ``seconds`` / ``calls`` / ``bytes`` count the all-reduces (the benchmark reads them)."""

    def __init__(self, d: Dist, secure_noise: bool, order: list[str], group=None):
        self.d, self.group = d, group  # group: a process subgroup (tests); None = all
        self.order = list(order)  # the engine's parameter order (noise draw order)
        self.noise_before = bool(secure_noise)  # rank 0 adds its draw before the all-reduce
        self.seconds, self.calls, self.bytes = 0.0, 0, 0

    def aggregate(self, total: dict, loss_sum: torch.Tensor, n: int, add_noise):
        """(Σ_ranks total + N(0, σ²C²) once, Σ_ranks loss_sum, Σ_ranks n) on every rank."""
        import torch.distributed as td

        total = {n: total[n] for n in self.order}  # one layout on every rank, empty shares included
        if self.noise_before and self.d.rank == 0:
            add_noise(total)
        grads = list(total.values())
        ref = grads[0]
        flat = torch.cat(
            [g.reshape(-1) for g in grads]
            + [
                loss_sum.detach().reshape(1).to(ref),
                torch.tensor([float(n)], dtype=ref.dtype, device=ref.device),
            ]
        )
        t0 = time.perf_counter()
        _collective(td.all_reduce, flat, op=td.ReduceOp.SUM, group=self.group)
        if flat.is_cuda:
            torch.cuda.synchronize(flat.device)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.bytes = flat.numel() * flat.element_size()
        o = 0
        with torch.no_grad():
            for g in grads:
                g.copy_(flat[o : o + g.numel()].view_as(g))
                o += g.numel()
        if not self.noise_before:
            add_noise(total)  # the identical draw on every rank, once
        return total, flat[o].clone(), int(round(float(flat[o + 1])))
