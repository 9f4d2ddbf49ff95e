"""python -m dpsgd.data: seed the data root (see datasets.main)."""
import sys

from dpsgd.data.datasets import main

sys.exit(main())
