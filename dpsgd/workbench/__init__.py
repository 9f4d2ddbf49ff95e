"""DP-SGD on your own model and data: the public training object (``PrivateTrainer``), and the
lot-and-charge core that the command line's training runs too (``lots.Lots``). docs/API.md."""
