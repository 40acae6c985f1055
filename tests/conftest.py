import os

import pytest

# One intra-op thread per process: the multi-process tests run several processes on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long runs; CI runs the short versions, benchmarks run these")


@pytest.fixture(scope="session")
def kjv(tmp_path_factory):
    """The KJV corpus for 2 clusters (tokenizer + per-cluster shards + validation), built once per session."""
    from megatron_dilocox.data.prepare import prepare
    out = tmp_path_factory.mktemp("kjv")
    prepare(str(out), num_clusters=2, vocab_size=4096)
    return out
