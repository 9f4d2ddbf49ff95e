"""``python -m dpsgd.audit run ...``: a one-run audit of a training configuration
(``dpsgd.audit.onerun.run``); ``python -m dpsgd.audit rescore RUN_DIR``: its audit.json recomputed
from the run's files; ``python -m dpsgd.audit bound --scores F.csv ...``: every one-run bound of a
score file against a claim (``dpsgd.audit.onerun.bound_file``);
``python -m dpsgd.audit [step] ...``: the one-step distinguishing game
(``dpsgd.audit.game.cli``)."""

import sys

USAGE = """usage: python -m dpsgd.audit COMMAND ...

  run KEY=VALUE ...     a one-run audit of a training configuration (the training keys, plus
                        audit.*): trains it with canaries, writes audit.json (docs/AUDIT.md)
  rescore RUN_DIR       recompute a finished audit's audit.json from its run's files
  bound --scores F.csv  every one-run lower bound of a score file against a claim
  step ...              the one-step distinguishing game (the default command)

python -m dpsgd.audit COMMAND --help: the options of one command."""

command = sys.argv[1] if len(sys.argv) > 1 else None
if command in ("-h", "--help"):
    print(USAGE)
    sys.exit(0)
if command == "run":
    from .onerun.run import main as run_main

    run_main(sys.argv[2:])
    sys.exit(0)
if command == "rescore":
    from .onerun.run import rescore_main

    sys.exit(rescore_main(sys.argv[2:]))
if command == "bound":
    from .onerun.bound_file import main as bound_main

    sys.exit(bound_main(sys.argv[2:]))
if command == "step":
    del sys.argv[1]

from .game.cli import main  # noqa: E402

sys.exit(main())
