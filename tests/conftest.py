"""Test tiers and the fixtures every tier shares.

Every test carries exactly one *tier* marker, by what it needs to run: a module's ``pytestmark`` where all of
its tests need the same, else a marker on each test:

- ``unit``: one process, pure Python/PyTorch (and static checks of files); seconds.
- ``core``: several real processes in gloo worlds (one per cluster) and the authenticated inter-cluster group;
  no Megatron.
- ``megatron``: real Megatron ``pretrain()`` under torchrun on CPU.
- ``netns``: network namespaces, veth and ``tc`` (root): a shaped or cut link between clusters.
- ``slurm``: a real SLURM (slurmctld + slurmd) started on this host.
- ``composition``: the composition matrix (docs/composition.md): real Megatron runs covering every pair of levels.

``slow`` is orthogonal: long runs (soaks, long horizons) that CI leaves to ``-m slow``; each has a short version
in CI. ``bash scripts/test.sh --quick`` runs ``unit`` and ``core``; ``bash scripts/test.sh`` (CI) runs every
tier. See docs/testing.md.
"""
import os

import pytest

from tests.wan_helpers import load_wan

# One intra-op thread per process: the multi-process tests run several processes on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")

TIERS = {
    "unit": "one process, pure Python/PyTorch or static file checks",
    "core": "several real processes and gloo groups, no Megatron",
    "megatron": "real Megatron pretrain() under torchrun on CPU",
    "netns": "network namespaces, veth and tc (root): a shaped or cut link",
    "slurm": "a real SLURM started on this host",
    "composition": "the composition matrix: real Megatron runs, every pair of the defaults' levels (docs/composition.md)",
}


def pytest_configure(config):
    for name, what in TIERS.items():
        config.addinivalue_line("markers", f"{name}: tier: {what}")
    config.addinivalue_line("markers", "slow: long runs; CI runs the short versions, benchmarks run these")


def tiers_of(item) -> list[str]:
    return sorted({m.name for m in item.iter_markers() if m.name in TIERS})


def pytest_collection_modifyitems(config, items):
    """Every test has exactly one tier (a test without one, or with two, fails collection, naming itself);
    ``slow`` tests are skipped unless ``-m`` names ``slow`` or DILOCOX_RUN_SLOW=1."""
    wrong = [f"{item.nodeid} {tiers_of(item) or '(none)'}" for item in items if len(tiers_of(item)) != 1]
    if wrong:
        raise pytest.UsageError("every test needs exactly one tier marker, one of " + ", ".join(TIERS)
                                + " (tests/conftest.py): " + "; ".join(wrong[:10]))
    if "slow" in (config.getoption("-m") or "") or os.environ.get("DILOCOX_RUN_SLOW") == "1":
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


@pytest.fixture(scope="module")
def wan():
    """scripts/wan/wan.py loaded (tests/wan_helpers.py), with no testbed up before or after the module's tests:
    a stale one from an earlier run is torn down first, whatever a failing test left behind afterwards."""
    mod = load_wan()
    mod.down(kill=True)
    yield mod
    mod.down(kill=True)
