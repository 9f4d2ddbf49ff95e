"""Public pretraining for the paper's CIFAR-10 experiment (Abadi et al. 2016, §5.3).

    python -m dpsgd.pretrain [key=value ...] [--out data/pretrained/cifar100_convs.pt]

A NON-private run (``experiment=cifar100_pretrain``: the same convolutional stack with a 100-class
head on CIFAR-100, the same augmentation and standardisation as the CIFAR-10 runs) trained by the
ordinary loop (``train.train``) in its own run folder
``outputs/cifar100_pretrain/<date>/<time>_seed<seed>``; then the trained convolutions
(``features.*``) are written as a hash-checked artifact (``pretrained.save``: ``<out>`` and its
sidecar ``<out>.json`` with the SHA-256, the resolved config, the run folder and its accuracies).
The paper treats CIFAR-100 as public, so nothing is charged; a DP run loads the artifact with
``model.pretrained=<out> model.freeze=features``.

Every refusal (bad key, missing data, an existing ``--out``) is one line and exit code 2, before
anything is written. ``make data/pretrained/cifar100_convs.pt`` runs this when the file is missing.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dpsgd.config.schema import validate
from dpsgd.core.errors import ConfigError
from dpsgd.models.networks import FREEZE
from dpsgd.launch.cli import compose, data_ready, fresh_dir, run_or_exit

PRESET = "experiment=cifar100_pretrain"
DEFAULT_OUT = "data/pretrained/cifar100_convs.pt"
EXPORT = "features"  # the public part: the convolutional stack (models.FREEZE["features"])


def pretrain(overrides: list[str], out: str | Path, run_dir: str | Path | None = None) -> dict:
    """Train non-privately with the preset and ``overrides``, export ``features.*`` to ``out``;
    returns the sidecar's content. ConfigError / DataUnavailable before anything is written."""
    from dpsgd.run.checkpoint import load_checkpoint
    from dpsgd.models.pretrained import relative, save, sidecar
    from dpsgd.train import train

    out = Path(out)
    c = validate(compose([PRESET, *overrides]))
    if c.privacy.private:
        raise ConfigError(
            "privacy.private=true: pretraining uses public data (CIFAR-100) and is not private; "
            "its cost is never charged"
        )
    if out.suffix != ".pt":
        raise ConfigError(
            f"--out={out}: must end in .pt (the sidecar is {out.with_suffix('.json').name})"
        )
    for p in (out, sidecar(out)):
        if p.exists():
            raise ConfigError(
                f"--out={out}: {p} already exists; never overwritten (delete it to rebuild)"
            )
    data_ready(c)
    run_dir = (
        Path(run_dir)
        if run_dir
        else Path(
            "outputs",
            c.name,
            time.strftime("%Y-%m-%d"),
            time.strftime("%H-%M-%S") + f".{time.time_ns() % 10**6:06d}_seed{c.seed}",
        )
    )
    fresh_dir("hydra.run.dir", run_dir)
    st = train(c, run_dir, [PRESET, *overrides])
    model = load_checkpoint(run_dir)["model"]
    tensors = {n: t for n, t in model.items() if n.startswith(FREEZE[EXPORT])}
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    last = dict(zip(rows[0].split(","), rows[-1].split(","))) if len(rows) > 1 else {}
    meta = {
        "run_dir": relative(run_dir),
        "epochs": st["epochs"],
        "steps": st["steps"],
        "train_accuracy": float(last.get("train_accuracy", "nan")),
        "test_accuracy": float(last.get("test_accuracy", "nan")),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "config": c.to_dict(),
    }
    sha = save(out, tensors, meta)
    print(
        f"pretrain: wrote {out} ({len(tensors)} tensors, sha256 {sha}) and {sidecar(out).name}; "
        f"CIFAR-100 test accuracy {meta['test_accuracy']:.4f}",
        flush=True,
    )
    return {"sha256": sha, **meta}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m dpsgd.pretrain",
        description="Non-private CIFAR-100 pretraining of the CIFAR-10 network's convolutions "
        "(paper §5.3); writes a hash-checked artifact.",
    )
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help=f"config overrides after {PRESET}"
    )
    p.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help=f"artifact path (default {DEFAULT_OUT}; sidecar .json beside it)",
    )
    p.add_argument(
        "--run-dir",
        default=None,
        help="run folder of the pretraining (default outputs/<name>/<date>/...)",
    )
    a = p.parse_args(argv)
    run_or_exit(lambda: pretrain(a.overrides, a.out, a.run_dir))


if __name__ == "__main__":
    main()
