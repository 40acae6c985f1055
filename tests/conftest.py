import os

import pytest

# One intra-op thread per process: the multi-process tests run several processes on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long runs; CI runs the short versions, benchmarks run these")


def pytest_collection_modifyitems(config, items):
    """CI (``bash scripts/test.sh``) skips ``slow`` tests; ``-m slow`` or DILOCOX_RUN_SLOW=1 runs them."""
    if config.getoption("-m") or os.environ.get("DILOCOX_RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow or DILOCOX_RUN_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def kjv(tmp_path_factory):
    """The KJV corpus for 2 clusters (tokenizer + per-cluster shards + validation), built once per session."""
    from megatron_dilocox.data.prepare import prepare
    out = tmp_path_factory.mktemp("kjv")
    prepare(str(out), num_clusters=2, vocab_size=4096)
    return out
