"""Private hyperparameter selection over DP-SGD runs (``python -m dpsgd.tune``).

Papernot & Steinke 2022 (ICLR, arXiv 2110.03620): draw K from a chosen distribution, train K
candidates (hyperparameters drawn uniformly from a Hydra-style search space) as ordinary DP-SGD
runs, score each on a validation split of the training data (noisy count of correct predictions),
and release only the best. The math is ``dpsgd/accountant/selection.py``; here:

* ``space``: the search space (``key=a,b,c`` choices), each point's validated config and its charge
  (q, lots, k);
* ``sweep``: the plan (K, candidates, seeds; written ahead), the runs, resume, the winner and the
  statement;
* ``winner``: the winner's saved model on the real test set, once, after selection (never used to
  select);
* ``cli``: the command line.
"""
