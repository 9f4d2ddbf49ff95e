"""DP-SGD on your own model and data: the engine of your own loop (``engine.make_private``), the
public training object that loops over it (``PrivateTrainer``), and the lot-and-charge core that the
command line's training runs too (``lots.Lots``). docs/API.md."""
