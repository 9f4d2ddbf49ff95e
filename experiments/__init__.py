"""Experiments of Abadi et al. 2016 (arXiv 1607.00133 v2): figure and table scripts.

- ``figure2``  ε vs epochs from the accountants alone (no training) → results/figure2.csv
- ``collect``  Hydra run / multirun folders → tidy CSVs in results/ (figure3/4/5, summary)
- ``figures``  every figure and results/README.md, drawn only from the committed CSVs
- ``paper``    reruns every experiment (presets, Figure-5 sweeps), then collect and figures
- ``claims``   the numbers the paper states, to be drawn and tabulated next to ours
"""
