"""Clusters must agree: every cluster posts a fingerprint at rendezvous (parallel layout, model shape, seed,
optimizer, DiLoCoX settings, the outer-lr warm-up resolved from ``--train-iters``, package versions, the shapes it
will send), and any difference stops every cluster naming the key. Real processes and the real
``InterClusterGroup``, one case per kind of difference (plus a control that joins); the fingerprints are built by
``seam.fingerprint`` from each cluster's args, config and views. The end-to-end case (two Megatron clusters with a
different ``--seed``) is in ``tests/test_bad_input.py``.
"""
from __future__ import annotations

import secrets
from types import SimpleNamespace

import pytest
import torch

from megatron_dilocox.harness.spawn import free_port

pytestmark = pytest.mark.core

MEGATRON_ARGS = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                     virtual_pipeline_model_parallel_size=None, context_parallel_size=1, expert_model_parallel_size=1,
                     data_parallel_size=1, use_distributed_optimizer=False, num_layers=4, hidden_size=64,
                     ffn_hidden_size=256, num_attention_heads=4, seq_length=128, padded_vocab_size=4096, seed=1234,
                     params_dtype=torch.float32, optimizer="adam")


def shapes(hidden):
    return [[4096, hidden], [3 * hidden, hidden], [3 * hidden], [hidden, hidden], [hidden]]


def _fingerprints(monkeypatch, args1=None, dilocox1=None, shapes1=None, version1=None):
    """Cluster 0's and cluster 1's fingerprints, built by seam.fingerprint from their args, config and views."""
    import megatron_dilocox
    from megatron_dilocox.config import DiLoCoXConfig
    from megatron_dilocox.glue.seam import fingerprint
    out = []
    for c in range(2):
        other = c == 1  # cluster 1 takes the differing values
        cfg = DiLoCoXConfig(num_clusters=2, cluster_id=c, rendezvous="127.0.0.1:1", secret="x",
                            **(dilocox1 if other and dilocox1 else {}))
        args = SimpleNamespace(**dict(MEGATRON_ARGS, **(args1 if other and args1 else {})))
        views = [torch.empty(s) for s in (shapes1 if other and shapes1 else shapes(64))]
        with monkeypatch.context() as m:
            if other and version1:
                m.setattr(megatron_dilocox, "__version__", version1)
            out.append(fingerprint(cfg, args, views))
    return out


def join_each(cluster: int, local_rank: int, cases: list) -> list:
    """In each case's own rendezvous, join as ``cluster`` with that fingerprint; 'joined' or the error."""
    from megatron_dilocox.config import DiLoCoXConfig
    from megatron_dilocox.net.topology import InterClusterGroup, connect_store
    results = []
    for case in cases:
        cfg = DiLoCoXConfig(num_clusters=2, cluster_id=cluster, rendezvous=case["rendezvous"], secret=case["secret"],
                            timeout_seconds=30).validate()
        try:
            store = connect_store(cfg, host_store=(cluster == 0))
            group = InterClusterGroup(cfg, local_rank, store, fingerprint=case["fingerprints"][cluster])
            if hasattr(group, "close"):
                group.close()
            results.append("joined")
        except Exception as exc:
            results.append(f"{type(exc).__name__}: {exc}")
    return results


PREFIX = "RendezvousError: DiLoCoX rendezvous: clusters disagree (local rank 0): "


@pytest.fixture(scope="module")
def disagreements():
    import megatron.core

    import megatron_dilocox
    from megatron_dilocox.harness.spawn import run_clusters
    mp = pytest.MonkeyPatch()
    version = megatron_dilocox.__version__
    core = megatron.core.__version__.split("+")[0]  # (seam.fingerprint leaves out the local part: a checkout's hash)
    fp_dilocox = _fingerprints(mp, dilocox1=dict(h=8))
    cases = {
        "layout": (_fingerprints(mp, args1=dict(pipeline_model_parallel_size=1)),
                   "pipeline_model_parallel_size: cluster 0 has '2', cluster 1 has '1' (sites whose parallel layouts "
                   "differ: start every site with --dilocox-exchange-layout canonical)"),
        "seed": (_fingerprints(mp, args1=dict(seed=4321)), "seed: cluster 0 has '1234', cluster 1 has '4321'"),
        "model-shape": (_fingerprints(mp, args1=dict(hidden_size=96), shapes1=shapes(96)),
                        f"hidden_size: cluster 0 has '64', cluster 1 has '96'; "
                        f"shapes: cluster 0 has {shapes(64)!r}, cluster 1 has {shapes(96)!r}"),
        "dilocox-settings": (fp_dilocox, "dilocox.h: cluster 0 has 50, cluster 1 has 8"),
        # the default outer-lr warm-up is a fifth of --train-iters (200 when the length is unknown)
        "run-length": (_fingerprints(mp, args1=dict(train_iters=500)),
                       "outer_lr_warmup_iters: cluster 0 has 200, cluster 1 has 100"),
        "package-version": (_fingerprints(mp, version1=version + "+other"),
                            f"megatron_dilocox: cluster 0 has '{version}', cluster 1 has '{version}+other'"),
        "megatron-core-version": (None, f"megatron_core: cluster 0 has '{core}', cluster 1 has '{core}.post1'"),
        "same": (_fingerprints(mp), None),  # control: the same settings join (last: its group stays up)
    }
    fp = _fingerprints(mp)
    fp[1] = dict(fp[1], megatron_core=core + ".post1")  # as seam.fingerprint reads megatron.core.__version__
    cases["megatron-core-version"] = (fp, cases["megatron-core-version"][1])
    mp.undo()
    secret = "join-" + secrets.token_hex(8)
    spec = [dict(rendezvous=f"127.0.0.1:{free_port()}", secret=secret, fingerprints=fps) for fps, _ in cases.values()]
    res = run_clusters(join_each, 2, 1, args=(spec,), timeout=120)
    return {name: ([res[(c, 0)][i] for c in range(2)], expected) for i, (name, (_, expected)) in enumerate(cases.items())}


@pytest.mark.parametrize("kind", ["layout", "seed", "model-shape", "dilocox-settings", "run-length", "package-version",
                                  "megatron-core-version", "same"])
def test_rendezvous_refuses_clusters_that_disagree_naming_the_difference(disagreements, kind):
    results, expected = disagreements[kind]
    for cluster, got in enumerate(results):
        assert got == ("joined" if expected is None else PREFIX + expected), (cluster, got)


def test_differing_dilocox_setting_is_named_by_itself(disagreements):
    results, _ = disagreements["dilocox-settings"]
    for got in results:
        assert "h: cluster 0 has 50, cluster 1 has 8" in got  # --dilocox-h named
        assert "outer_lr" not in got  # settings both clusters share are not listed
