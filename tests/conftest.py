import os

import pytest

# One intra-op thread per process: the multi-process tests run several processes on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long runs; CI runs the short versions, benchmarks run these")
