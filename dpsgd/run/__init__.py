"""A run of Algorithm 1.

Its parts, state, opening, resume guard, checkpoint, run directory lock, evaluation and report.
"""
