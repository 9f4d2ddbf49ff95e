"""The one-step distinguishing game against the real DP-SGD step (``python -m dpsgd.audit step``);
the modules are listed in ``dpsgd.audit``'s docstring."""
