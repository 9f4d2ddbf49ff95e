"""Accountants by Rényi DP: a curve ε(α) per lot, composed by adding curves, converted to
(ε, δ) once.

rdp.py         the Poisson-subsampled Gaussian (Mironov, Talwar & Zhang 2019); RDP → (ε, δ)
moments.py     the paper's moments accountant (Abadi et al. 2016), on rdp's log moments
wor.py         fixed-size lots, sampling without replacement (Wang, Balle & Kasiviswanathan 2019)
allocation.py  random allocation, one epoch of balls-in-bins lots (Feldman & Shenfeld 2025)
"""
