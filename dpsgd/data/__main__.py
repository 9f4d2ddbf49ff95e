"""python -m dpsgd.data: seed the data root (see archives.main)."""

import sys

from dpsgd.data.archives import main

sys.exit(main())
