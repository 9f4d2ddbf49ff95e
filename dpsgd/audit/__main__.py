"""``python -m dpsgd.audit``: the command line in ``dpsgd.audit.cli``."""
import sys

from .cli import main

sys.exit(main())
