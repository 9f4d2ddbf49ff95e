"""A run folder as ``python -m dpsgd.train experiment=<preset>`` leaves it (metrics.csv,
privacy.json, .hydra), built from a committed run's files: what the result collectors
(experiments.seeds, figure 6) read, without training."""

import shutil
from pathlib import Path

import pandas as pd
import yaml


def fake_run(
    root: Path, src: Path, preset: str, name: str, seed: int = 0, overrides=(), acc=None
) -> Path:
    """``root/name`` from ``src``'s metrics.csv (last test accuracy set to ``acc`` when given) and
    privacy.json; its .hydra says experiment=``preset``, ``seed`` and the further ``overrides``."""
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    m = pd.read_csv(src / "metrics.csv")
    if acc is not None:
        m.loc[m.index[-1], "test_accuracy"] = acc
    m.to_csv(run / "metrics.csv", index=False)
    shutil.copy2(src / "privacy.json", run / "privacy.json")
    (run / ".hydra" / "config.yaml").write_text(
        yaml.safe_dump({"seed": seed, "device": "cpu", "name": preset})
    )
    (run / ".hydra" / "hydra.yaml").write_text(
        yaml.safe_dump({"hydra": {"runtime": {"choices": {"experiment": preset}}}})
    )
    (run / ".hydra" / "overrides.yaml").write_text(
        yaml.safe_dump([f"experiment={preset}", *overrides])
    )
    return run
