"""Experiments of Abadi et al. 2016 (arXiv 1607.00133 v2): figure and table scripts, in layers.

Each module imports only modules of the layers below it.

1. Shared: ``claims`` (the numbers the paper states), ``paths`` (repository folders; paths written
   without this machine's layout), ``style`` (how every figure looks and is saved), ``runs``
   (finding run folders and reading what they are), ``jobs`` (running training commands, own
   processes or a Hydra launcher), ``planning`` (a planned run's config composed from conf/, a
   sweep's points, the epochs a run takes).
2. One per figure or table: ``figure2`` (ε vs epochs from the accountants alone → figure2.csv, and
   its figure), ``mnist_figures`` (Figures 3-5 and privacy–utility), ``figure6`` (CIFAR-10 rows and
   figure), ``frontier_figure`` (frontier figure and table), ``seeds`` (preset runs over seeds →
   seeds.csv, and their spread).
3. Writers of results/: ``collect`` (run folders → figure3/4/5/6.csv, summary.csv; classify the
   runs, then one writer per CSV), ``readme`` (results/README.md from the CSVs).
4. ``figures``: the one main that redraws every figure and regenerates results/README.md from the
   committed CSVs (``make figures``).
5. Runners, which train, collect and then redraw through ``figures``: ``paper`` (every experiment of
   the paper: ``make paper``) and ``frontier`` (the privacy–utility frontier: ``make frontier``).
"""
