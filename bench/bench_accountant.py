"""Accountant speed: python -m bench.bench_accountant

Targets: ε after every epoch for 1,000 epochs at q = 0.01 under the moments accountant <= 50 ms in
total; PLD for 10,000 steps at q = 0.01, σ = 1, δ = 1e-5 <= 2 s on one CPU core (cold caches).
Also the per-call cost the training loop pays at 70,000 lots (warm caches). Writes
results/bench_accountant.csv (benchmark,value_s,target_s,notes); timings are wall-clock and noisy
on a shared machine (best of a few repeats is reported).
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

from bench import write_csv
from dpsgd.accountant import Ledger, moments, pld, rdp
from dpsgd.accountant.events import Poisson
from dpsgd.accountant.privacy_loss.pld_fft import _step_fft
from dpsgd.accountant.privacy_loss.pld_lot import _step_pmf

DELTA = 1e-5
OUT = Path("results/bench_accountant.csv")


def _clear_caches():
    for f in (moments.log_moments_unchecked, rdp.rdp_curve, _step_pmf, _step_fft):
        f.cache_clear()


def bench_moments_1000_epochs(repeats=3):
    best = float("inf")
    for _ in range(repeats):
        _clear_caches()
        t = time.perf_counter()
        led = Ledger()
        for _ in range(1000):
            led.record(Poisson(0.01, 4.0), 100)
            led.epsilon(DELTA, "moments")
        best = min(best, time.perf_counter() - t)
    return best


def bench_pld_10k(repeats=3):
    best = float("inf")
    for _ in range(repeats):
        _clear_caches()
        t = time.perf_counter()
        pld.epsilon(0.01, 1.0, 10_000, DELTA)
        best = min(best, time.perf_counter() - t)
    return best


def bench_per_call_70k(accountant, convention, sigma=2.0, groups=2, calls=5):
    """Mean cost of one led.epsilon at ~70,000 lots after the curves are cached (one epoch
    apart)."""
    led = Ledger()
    led.record(Poisson(0.01, sigma, groups), 69_000)
    led.epsilon(DELTA, accountant, convention)  # warm the per-(q, σ) caches
    times = []
    for _ in range(calls):
        led.record(Poisson(0.01, sigma, groups), 100)
        t = time.perf_counter()
        led.epsilon(DELTA, accountant, convention)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def bench_steps_within_pld():
    led = Ledger()
    led.record(Poisson(0.01, 2.0, 2), 20_000)
    t = time.perf_counter()
    led.steps_within(8.0, DELTA, Poisson(0.01, 2.0, 2), "pld")
    return time.perf_counter() - t


def main():
    try:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one CPU core
    except (AttributeError, OSError):
        pass
    rows = [
        (
            "moments_eps_every_epoch_1000_epochs_q0.01",
            bench_moments_1000_epochs(),
            0.050,
            "total for 1000 x (record 100 lots + epsilon), sigma=4, cold caches, best of 3",
        ),
        (
            "pld_10000_steps_q0.01_sigma1",
            bench_pld_10k(),
            2.0,
            "cold caches, both directions, best of 3",
        ),
    ]
    for acc, target in (("moments", 0.005), ("rdp", 0.005), ("pld", 0.100)):
        for conv in ("joint", "per_tensor"):
            rows.append(
                (
                    f"ledger_epsilon_{acc}_{conv}_70k_lots",
                    bench_per_call_70k(acc, conv),
                    target,
                    "per call, warm caches, q=0.01 sigma=2 groups=2, median of 5",
                )
            )
    rows.append(
        (
            "ledger_steps_within_pld",
            bench_steps_within_pld(),
            2.0,
            "target eps 8 after 20k lots, q=0.01 sigma=2 groups=2 joint",
        )
    )
    host = f"{platform.machine()} {os.cpu_count()} cpus, shared machine (noisy)"
    write_csv(
        [
            {
                "benchmark": name,
                "value_s": f"{val:.6f}",
                "target_s": target,
                "notes": f"{note}; {host}",
            }
            for name, val, target, note in rows
        ],
        OUT,
        ["benchmark", "value_s", "target_s", "notes"],
    )
    print(f"{'benchmark':<48}{'value_s':>12}{'target_s':>10}")
    for name, val, target, _ in rows:
        flag = "" if val <= target else "  (over target)"
        print(f"{name:<48}{val:>12.4f}{target:>10.3f}{flag}")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
