"""The composition matrix's page and rows (megatron_dilocox/harness/matrix.py, docs/composition.md): the rows
cover every pair of levels that can run together, every pair left out has a reason, the refusals the page
names are the product's, and the page is the generator's output."""
import itertools
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_dilocox.config import DiLoCoXConfig, DiLoCoXConfigError
from megatron_dilocox.glue.canonical import check_supported
from megatron_dilocox.harness import matrix

pytestmark = pytest.mark.unit


def test_the_rows_cover_every_pair_that_can_run_together_and_are_valid():
    rows = matrix.covering_rows()
    assert all(matrix.valid(r) for r in rows)
    assert matrix.covered(rows) == matrix.possible_pairs()
    every = {frozenset({(a, x), (b, y)}) for a, b in itertools.combinations(matrix.FACTORS, 2)
             for x in matrix.FACTORS[a] for y in matrix.FACTORS[b]}
    # each pair is run or named with its reason, not both
    assert matrix.possible_pairs() | set(matrix.excluded()) == every
    assert not matrix.possible_pairs() & set(matrix.excluded())
    assert all(why and "no valid run" not in why for why in matrix.excluded().values())
    assert rows == matrix.covering_rows()  # deterministic
    assert len(rows) <= 10  # (6 is the least for a 3-level factor beside 2-level ones; CI time is bounded by it)


def test_the_refusals_the_page_names_are_refused_before_training():
    base = dict(num_clusters=2, rendezvous="h:1", secret="s")
    # (fragments under continue run: a rejoining site is handed every fragment's state, outer/handover.py)
    DiLoCoXConfig(**base, fragments=2, overlap="one-step-delay", on_peer_failure="continue").validate()
    canonical = DiLoCoXConfig(**base, exchange_layout="canonical").validate()
    with pytest.raises(DiLoCoXConfigError, match="does not handle MoE"):
        check_supported(canonical, SimpleNamespace(num_experts=4))
    with pytest.raises(DiLoCoXConfigError, match="needs --dilocox-fragments 1"):
        check_supported(DiLoCoXConfig(**base, exchange_layout="canonical", fragments=2,
                                      overlap="one-step-delay").validate(), SimpleNamespace(num_experts=None))


def test_the_page_is_current():
    script = [sys.executable, str(pathlib.Path(__file__).resolve().parent.parent / "scripts" / "composition_matrix.py"),
              "--check"]
    done = subprocess.run(script, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
