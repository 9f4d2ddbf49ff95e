"""One-run audit of a configuration: ``python -m dpsgd.audit run [overrides] [audit.key=value]``.

    python -m dpsgd.audit run experiment=mnist_medium audit.gradient_canaries=1000 \\
        audit.variant=correct

The configuration is the one ``python -m dpsgd.train`` takes (any preset, any override, torchrun
included); ``audit.*`` options (``instrument.AuditOptions``) are taken off the command line before
Hydra sees it, checked (one line naming the option, exit 2, before any work) and handed to every
process (and sweep job) through the environment variable ``DPSGD_AUDIT``. The run is trained with
the canaries in its data (``canaries.py``), then, in the run directory:

* ``audit.json`` — the claim (the run's own valid ε, for the dataset with the canaries), the
  last-iterate heuristic ε, and for the white-box (gradient canaries, every iterate) and black-box
  (input canaries, final model) games: m, how many were in, the guesses, the correct ones, the
  one-run lower bound ε_lb at confidence 1 − β (each game at β/g for g games, so that the larger of
  them holds at 1 − β), and the verdict (``violation`` when ε_lb > claimed ε);
* ``audit_scores.csv`` — every canary's score and bit (re-analysis without rerunning).

An audit run is labelled as such in privacy.json, checkpoint.pt, metrics.csv and on the console,
writes into ``outputs/audit/...`` unless ``hydra.run.dir`` is given, and is never resumed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

from dpsgd.core.checks import typed_number
from dpsgd.core.errors import ConfigError
from dpsgd.launch import main as launch
from dpsgd.run import distributed
from dpsgd.core.errors import one_line
from dpsgd.launch.cli import fail

from .instrument import AuditInstrument, AuditOptions
from .report import audit_report, scores_and_bits, write_report

ENV = "DPSGD_AUDIT"
RUN_DIR = "hydra.run.dir=outputs/audit/${name}/${now:%Y-%m-%d}/${now:%H-%M-%S.%f}_seed${seed}"


def options_from_env(env=None) -> AuditOptions:
    env = os.environ if env is None else env
    if ENV not in env:
        raise ConfigError(f"{ENV}: not set; run the audit as python -m dpsgd.audit run ...")
    return AuditOptions(**json.loads(env[ENV])).validate()


def audit_train(c, run_dir, overrides) -> dict:
    """``dpsgd.train.train`` with the audit's instrument; then audit.json (rank 0)."""
    from dpsgd.data.datasets import dataset_info
    from dpsgd.train import train

    options = options_from_env()
    if not c.privacy.private:
        raise ConfigError(
            "privacy.private=false: a non-private run claims nothing; there is nothing to audit"
        )
    if c.optimizer.name != "sgd" and options.gradient_canaries:
        raise ConfigError(
            f"optimizer={c.optimizer.name}: the white-box observer reads the noisy gradient back "
            "from DP-SGD's own update (θ_t − θ_t+1 = η g̃); audit gradient canaries with "
            "optimizer=sgd (any optimizer is post-processing of the same g̃)"
        )
    if c.privacy.noise != "independent":  # correlated noise (docs/CORRELATED_NOISE.md)
        raise ConfigError(
            f"privacy.noise={c.privacy.noise}: the one-run audit reads each step's noise as an "
            "independent draw (its noise check and bounds); audit privacy.noise=independent"
        )
    inst = AuditInstrument(options, dataset_info(c.dataset).classes)
    start = time.time()
    final = train(c, run_dir, overrides, instrument=inst)
    if distributed.current().writes and inst.parts is not None:
        scored = scores_and_bits(inst)
        sumsq = inst.observer.sumsq.numpy() if inst.observer is not None else None
        report = audit_report(
            c.to_dict(),
            options,
            inst.label,
            scored,
            inst.groups_used,
            final,
            time.time() - start,
            inst.placed,
            sumsq,
        )
        write_report(Path(run_dir), scored, report, sumsq)
    return final


def usage() -> str:
    """``audit run --help``: the command, its audit.* options with their defaults, and where the
    training overrides are described."""
    opts = "\n".join(
        f"  audit.{f.name}={f.default!r}" if not callable(f.default) else f"  audit.{f.name}"
        for f in fields(AuditOptions)
    )
    return (
        "usage: python -m dpsgd.audit run [training overrides] [audit.key=value ...]\n\n"
        "A one-run audit: trains the configuration (any preset or override that python -m "
        "dpsgd.train takes;\n"
        "see python -m dpsgd.train --help) with canaries in its data, then writes audit.json and\n"
        "audit_scores.csv into the run folder (docs/AUDIT.md).\n\naudit options (defaults):\n"
        + opts
    )


def split_args(args: list[str]) -> tuple[AuditOptions, list[str]]:
    """(the audit's options, the rest for Hydra); ConfigError naming an unknown or bad ``audit.*``
    key."""
    known = {f.name for f in fields(AuditOptions)}
    values, rest = {}, []
    for a in args:
        key, eq, value = a.partition("=")
        if not key.startswith("audit."):
            rest.append(a)
            continue
        name = key[len("audit.") :]
        if name not in known or not eq:
            raise ConfigError(
                f"{a}: unknown audit option; one of "
                f"{', '.join('audit.' + k for k in sorted(known))}"
            )
        values[name] = typed_number(value)
    return AuditOptions(**values).validate(), rest


def rescore_main(argv: list[str]) -> int:
    """``python -m dpsgd.audit rescore RUN_DIR [audit.beta=B]``: audit.json recomputed from the
    run's files; the previous audit.json is kept as audit.superseded.json."""
    from dpsgd.core.fileio import write_json
    from .report import AUDIT, rescore

    if not argv or not (Path(argv[0]) / AUDIT).is_file():
        print(
            f"error: rescore: {argv[0] if argv else 'RUN_DIR'}: not an audit run directory (no "
            f"{AUDIT})",
            file=sys.stderr,
        )
        return 2
    run_dir, beta = Path(argv[0]), None
    try:
        for a in argv[1:]:
            if not a.startswith("audit.beta="):
                raise ConfigError(f"{a}: rescore takes only audit.beta=<β>")
            beta = typed_number(a.partition("=")[2])
        report = rescore(run_dir, beta)
    except ConfigError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    (run_dir / AUDIT).replace(run_dir / "audit.superseded.json")
    write_json(run_dir / AUDIT, report)
    print(
        f"{run_dir / AUDIT}: ε_lb={report['eps_lower_bound']:.4g}, claimed "
        f"ε={report['eps_claimed']:.4g} → {report['verdict']}"
    )
    return 0


def check_canaries_fit(options: AuditOptions, args: list[str]) -> None:
    """A single run's data holds more rows than ``audit.input_canaries`` (they are taken from it):
    ConfigError naming the option before any folder is made. A sweep's jobs are checked as each
    starts (``canaries.add_canaries``)."""
    from dpsgd.config.overrides import override_key
    from dpsgd.config.schema import validate
    from dpsgd.launch.cli import compose, search_path, split_cli

    multirun, dirs, overrides = split_cli(args)
    if (
        not options.input_canaries
        or multirun
        or any(override_key(a) == "resume" for a in overrides)
    ):
        return
    N = validate(compose(overrides + search_path(dirs))).N
    if options.input_canaries >= N:
        raise ConfigError(
            f"audit.input_canaries={options.input_canaries}: needs fewer than the {N} training "
            "examples (the input canaries are taken from them)"
        )


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[2:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(usage())
        raise SystemExit(0)
    try:
        options, rest = split_args(args)
        check_canaries_fit(options, rest)
    except ConfigError as e:
        fail(one_line(e), 2)
    os.environ[ENV] = json.dumps(asdict(options))
    if not any(a.startswith(("hydra.run.dir=", "resume=")) for a in rest):
        rest = [RUN_DIR] + rest
    launch.main(audit_train, rest)
