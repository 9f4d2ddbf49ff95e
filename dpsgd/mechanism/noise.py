"""The Gaussian noise of Algorithm 1 (Abadi et al. 2016, line "Add noise": N(0, σ²C²I)).

Two sources:

* seeded (default): a dedicated ``torch.Generator`` so runs are reproducible and the noise stream
  can be checkpointed and resumed bit-exactly;
* secure (``secure=True``): bits from the operating system's CSPRNG (``os.urandom``), turned into
  float64 normals by the Box–Muller transform, and each released value is the average of four such
  draws scaled to the requested std (the mitigation of Holohan & Braghin 2021, "Secure random
  sampling in differential privacy", also used by Opacus' secure mode) against floating-point
  attacks on the noise (Mironov 2012). A fixed seed is refused in this mode. What it does not do is
  discussed in docs/SECURE_NOISE.md (the float32 cast and the addition to the gradient are still
  floating point).

Drawn ahead (seeded source on the CPU, ``ahead()``; off with ``DPSGD_NOISE_AHEAD=0``, and where
torch's threads take every usable core): after a lot, a worker thread draws the next lot's noise, the same sequence of
draws from the same generator as the lot just run made, while the main thread computes the next lot's
gradients on the other core. A draw the step then asks for is taken from there only if it is the
same request (count, std, dtype) in the same order; otherwise the generator is set back to the state
after the last draw taken and the draw is made then. So every value is the one the sequential
source would give, bit for bit, and ``state_dict`` (and ``generator``) always see the state after
the draws taken: a checkpoint never skips noise that was drawn ahead but not added.
"""

from __future__ import annotations

import math
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch


CHUNK = {"cpu": 1 << 16}  # elements drawn at once by add_ (other devices: whole tensor)
AHEAD_MAX = 1 << 24  # elements of a lot's noise drawn ahead at most (64 MiB of float32)
LOG_MAX = 1 << 14  # draws of one lot remembered for the next (more are drawn when asked)


def ahead_default(env=None) -> bool:
    """Whether noise is drawn ahead: ``DPSGD_NOISE_AHEAD`` (0 or 1) if set, else when this process
    may run on more cores than torch's threads use (the worker then has a core of its own)."""
    env = os.environ if env is None else env
    raw = env.get("DPSGD_NOISE_AHEAD", "").strip()
    if raw:
        return raw not in ("0", "false", "no")
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    return usable > torch.get_num_threads()


class GaussianNoise:
    """Draws N(0, std²) tensors from a seeded generator or from OS entropy."""

    def __init__(
        self,
        seed: int | None = None,
        secure: bool = False,
        device: str | torch.device = "cpu",
        ahead: bool | None = None,
    ):
        self.device = torch.device(device)
        self.secure = bool(secure)
        self._scratch = None  # add_'s reusable chunk buffer
        # drawing ahead (module doc): this lot's requests, the draws made ahead and their worker
        self.ahead_enabled = (
            (ahead_default() if ahead is None else bool(ahead))
            and not self.secure
            and self.device.type == "cpu"
        )
        self._log: list[tuple] = []  # (count, std, dtype) of every draw since the last ahead()
        self._ready: deque = deque()  # (count, std, dtype, values, generator state after)
        self._taken_state = None  # the generator's state after the last draw taken
        self._job = None
        self._pool, self._pool_pid = None, None
        if self.secure:
            if seed is not None:
                raise ValueError(
                    f"privacy.noise_seed={seed!r}: a fixed noise seed is refused when "
                    "privacy.secure_rng=true (secure noise comes from OS entropy and cannot be "
                    "replayed)"
                )
            self._gen = None
            self.seed = None
            return
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") >> 1
        self.seed = int(seed)
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(self.seed)

    @property
    def generator(self) -> torch.Generator | None:
        """The seeded generator, in the state after every draw taken (draws made ahead and not
        taken are given back first); None for the secure source."""
        if self.secure:
            return None
        self._give_back()
        return self._gen

    @property
    def name(self) -> str:
        return "os_urandom_box_muller_avg4" if self.secure else "torch_generator"

    def sample(self, shape, std: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A tensor of i.i.d. N(0, std²) entries with the given shape, on this source's device."""
        if std == 0:
            return torch.zeros(shape, dtype=dtype, device=self.device)
        if self.secure:
            n = int(np.prod(shape)) if len(shape) else 1
            # mean of 4 standard normals has variance 1/4: multiply by 2 to get a standard normal.
            z = sum(_urandom_standard_normal(n) for _ in range(4)) / 2.0
            return torch.from_numpy(z * std).reshape(shape).to(device=self.device, dtype=dtype)
        n = math.prod(tuple(shape))
        return self._normal(n, std, dtype).view(tuple(shape))

    def _normal(self, n: int, std: float, dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """n values of N(0, std²) from the generator: the draw made ahead for this request, else
        drawn now (into ``out`` when given) (module doc)."""
        req = (n, float(std), dtype)
        if self.ahead_enabled and len(self._log) < LOG_MAX:
            self._log.append(req)
        if self._job is not None or self._ready:
            self._settle()
            if self._ready and self._ready[0][:3] == req:
                *_, z, state = self._ready.popleft()
                self._taken_state = state
                return z
            self._give_back()
        if out is None:
            out = torch.empty(n, dtype=dtype, device=self.device)
        return out.normal_(0.0, float(std), generator=self._gen)

    def ahead(self) -> None:
        """Draw the next lot's noise on the worker thread: the requests of the lot just run (since
        the last call), in order, up to AHEAD_MAX values (module doc). A no-op when disabled."""
        plan, self._log = self._log, []
        if not self.ahead_enabled or not plan:
            return
        self._give_back()  # what the last lot did not take
        keep, total = [], 0
        for req in plan:
            total += req[0]
            if total > AHEAD_MAX:
                break
            keep.append(req)
        if os.getpid() != self._pool_pid:  # no pool yet, or one inherited through fork
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dpsgd-noise")
            self._pool_pid = os.getpid()
        self._taken_state = self._gen.get_state()
        self._job = self._pool.submit(self._draw_ahead, keep)

    def _draw_ahead(self, plan) -> None:
        for n, std, dtype in plan:
            z = torch.empty(n, dtype=dtype, device=self.device).normal_(
                0.0, std, generator=self._gen
            )
            self._ready.append((n, std, dtype, z, self._gen.get_state()))

    def _settle(self) -> None:
        """Wait for the worker (its exception, if any, raised here)."""
        job, self._job = self._job, None
        if job is not None:
            job.result()

    def _give_back(self) -> None:
        """Set the generator back to its state after the last draw taken, dropping the draws made
        ahead and not taken."""
        if self._job is None and not self._ready:
            return
        self._settle()
        if self._ready:
            self._ready.clear()
        self._gen.set_state(self._taken_state)

    def add_(self, t: torch.Tensor, std: float) -> torch.Tensor:
        """t += N(0, std² I) in place; on CPU, tensors over CHUNK elements are drawn in chunks into
        a small reusable buffer, so no noise tensor of t's size is allocated (memory of the DP
        step).

        The same draws as ``sample`` would give for the same shapes in the seeded mode up to how
        the stream is cut."""
        n = t.numel()
        if std == 0 or n == 0:
            return t
        chunk = CHUNK.get(t.device.type, n)
        if n <= chunk or self.secure or not t.is_contiguous():  # small: one draw, no slicing
            return t.add_(self.sample(t.shape, std, dtype=t.dtype))
        flat = t.view(-1)
        buf = self._scratch
        if buf is None or buf.dtype != t.dtype or buf.device != t.device or buf.numel() < chunk:
            buf = self._scratch = torch.empty(chunk, dtype=t.dtype, device=t.device)
        for s in range(0, n, chunk):
            m = min(chunk, n - s)
            flat[s : s + m].add_(self._normal(m, std, t.dtype, out=buf[:m]))
        return t

    # --- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        if self.secure:
            return {"secure": True}
        return {"secure": False, "seed": self.seed, "state": self.generator.get_state()}
        # (``generator`` gives back what was drawn ahead: the state after the draws taken)

    def load_state_dict(self, state: dict) -> None:
        if bool(state["secure"]) != self.secure:
            raise ValueError("privacy.secure_rng differs from the checkpoint's noise source")
        if not self.secure:
            self.seed = state["seed"]
            self.generator.set_state(state["state"])


def _urandom_standard_normal(n: int) -> np.ndarray:
    """n standard normals (float64) from os.urandom via Box–Muller (Box & Muller 1958)."""
    m = (n + 1) // 2
    bits = np.frombuffer(os.urandom(16 * m), dtype=np.uint64).reshape(2, m) >> np.uint64(11)
    u1 = (bits[0].astype(np.float64) + 1.0) * 2.0**-53  # (0, 1]: log is finite
    u2 = bits[1].astype(np.float64) * 2.0**-53  # [0, 1)
    r = np.sqrt(-2.0 * np.log(u1))
    z = np.concatenate([r * np.cos(2 * math.pi * u2), r * np.sin(2 * math.pi * u2)])
    return z[:n]
