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
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch


CHUNK = {"cpu": 1 << 16}  # elements drawn at once by add_ (other devices: whole tensor)


class GaussianNoise:
    """Draws N(0, std²) tensors from a seeded generator or from OS entropy."""

    def __init__(
        self, seed: int | None = None, secure: bool = False, device: str | torch.device = "cpu"
    ):
        self.device = torch.device(device)
        self.secure = bool(secure)
        self._scratch = None  # add_'s reusable chunk buffer
        if self.secure:
            if seed is not None:
                raise ValueError(
                    f"privacy.noise_seed={seed!r}: a fixed noise seed is refused when "
                    "privacy.secure_rng=true (secure noise comes from OS entropy and cannot be "
                    "replayed)"
                )
            self.generator = None
            self.seed = None
            return
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") >> 1
        self.seed = int(seed)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.seed)

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
        return torch.normal(
            0.0,
            float(std),
            size=tuple(shape),
            generator=self.generator,
            device=self.device,
            dtype=dtype,
        )

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
            z = buf[: min(chunk, n - s)]
            z.normal_(0.0, float(std), generator=self.generator)
            flat[s : s + z.numel()].add_(z)
        return t

    # --- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        if self.secure:
            return {"secure": True}
        return {"secure": False, "seed": self.seed, "state": self.generator.get_state()}

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
