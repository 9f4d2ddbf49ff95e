"""Correlated noise for DP-SGD (DP matrix factorisation: BandMF, BLT; docs/CORRELATED_NOISE.md).

    strategy.py   the strategy matrices C (banded Toeplitz, buffered linear Toeplitz), optimised for
                  a run's horizon; their sensitivity under cyclic participation and expected error
    toeplitz.py   lower-triangular Toeplitz algebra (products, inverses, column norms) in numpy
    noise.py      CorrelatedNoise: row t of C⁻¹Z streamed into each lot's noisy sum

The cyclic samplers these strategies are charged under live beside the other samplers
(``dpsgd/mechanism/cyclic.py``).
"""
