"""`make test-other-cpu` reruns the fast suite as a CPU without AVX2 or AVX-512 computes it; this
checks that the emulated CPU is really in force, so that a renamed switch cannot turn that check
into a silent rerun on this machine's kernels.

``DPSGD_CPU_PROFILE=baseline`` is set by the Makefile beside the switches themselves: numpy's
exp/log/FFT kernels at its X86_V2 baseline (``NPY_DISABLE_CPU_FEATURES``), torch's scalar kernels
(``ATEN_CPU_CAPABILITY=default``), MKL's compatible code path (``MKL_CBWR=COMPATIBLE``; it has no
query from Python and is not checked here). Without a profile (``make test``) there is nothing to
check.
"""

import os

import pytest

PROFILE = os.environ.get("DPSGD_CPU_PROFILE")
NUMPY_OFF = ("X86_V3", "X86_V4", "AVX512_ICL")  # numpy's dispatch targets above its baseline


@pytest.mark.skipif(
    PROFILE is None, reason="no emulated CPU (DPSGD_CPU_PROFILE unset: make test-other-cpu sets it)"
)
def test_the_emulated_cpu_is_in_force():
    import torch
    from numpy._core._multiarray_umath import __cpu_features__ as numpy_features

    assert PROFILE == "baseline", f"DPSGD_CPU_PROFILE={PROFILE}: the only profile is baseline"
    on = [f for f in NUMPY_OFF if numpy_features.get(f)]
    assert not on, f"numpy still dispatches to {on}: NPY_DISABLE_CPU_FEATURES is not in force"
    assert torch.backends.cpu.get_cpu_capability() == "DEFAULT", (
        f"torch runs {torch.backends.cpu.get_cpu_capability()} kernels: "
        "ATEN_CPU_CAPABILITY is not in force"
    )
