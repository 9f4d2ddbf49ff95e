"""The one-run audit of a training run (``python -m dpsgd.audit run``, ``rescore``, ``bound``); the
modules are listed in ``dpsgd.audit``'s docstring."""
