"""Accountants by privacy loss distribution (PLD): a discretised loss per lot, composed by FFT.

pld_lot.py        one Poisson lot's PLD, discretised pessimistically (connect-the-dots)
pld_fft.py        composition by FFT: Chernoff windows, exponential tilting, δ(ε) and ε(δ)
pld.py            the entry point: compose, ε(δ), δ(ε) of Poisson lots
wor_pld.py        one fixed-size lot's PLD (the symmetric dominating pair, replace-one)
truncated.py      truncated Poisson lots (Ganesh et al. 2025); mixed lots composed by FFT
shuffle_lower.py  a lower bound on ε for shuffled lots (Chua et al. 2024)
"""
