"""Shared test setup.

Tests run with one intra-op thread (torch and the subprocesses the tests start): their tensors are
small, and on a busy 2-core CI machine thread oversubscription makes OpenMP several times slower.
Results do not depend on it; set DPSGD_TEST_THREADS to change it.
"""
import os

import torch

THREADS = int(os.environ.get("DPSGD_TEST_THREADS", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))   # inherited by subprocesses
torch.set_num_threads(THREADS)
