"""megatron_dilocox: DiLoCoX (decentralized low-communication training) as a Megatron-LM plugin.

    from megatron_dilocox import DiLoCoX, DiLoCoXConfig     # a plain PyTorch loop (api.py)
    torchrun ... -m megatron_dilocox.pretrain_gpt --dilocox ...   # Megatron (pretrain_gpt.py)

The rooms, from the algorithm out:

- ``config`` (every knob), ``metrics`` (one row per round), ``compression/`` (the pseudo-gradient codec),
  ``outer/`` (the round, the outer optimizer, the plan) and ``net/`` (rendezvous, membership, the
  inter-cluster groups, the standalone coordinator): pure PyTorch, no Megatron.
- ``api`` (the plain PyTorch wrapper) and ``arguments`` (the ``--dilocox-*`` flags, generated from the
  config; no Megatron import either).
- ``glue/`` (the seam inside Megatron's optimizer step, checkpoints, the CPU backend) and ``pretrain_gpt``
  (the Megatron entry): these import Megatron, as does ``data/prepare`` (Megatron's indexed-dataset writer
  makes the corpus' ``.bin``/``.idx``). ``tests/test_layout.py`` pins that set.
- ``harness/`` (C clusters on one host: the launcher, the core tests' spawner, the main job and its plot),
  ``sim/`` (the cost model, pure Python) and ``data/`` (the offline corpora).

``coordinator``, ``launch`` and ``main_job`` at this level are the public ``python -m`` entries; their
code lives in ``net/`` and ``harness/``. ``DiLoCoX`` and ``DiLoCoXConfig`` are imported on first use, so
that importing any submodule (e.g. a ``torch_dist`` checkpoint helper re-importing ``pretrain_gpt``, or the
torch-free ``sim``) does not pull in torch and the whole core.
"""
__version__ = "0.1.0"
__all__ = ["DiLoCoX", "DiLoCoXConfig", "RunStopped", "__version__"]


def __getattr__(name):
    if name == "DiLoCoX":
        from megatron_dilocox.api import DiLoCoX
        return DiLoCoX
    if name == "RunStopped":
        from megatron_dilocox.outer.sync import RunStopped
        return RunStopped
    if name == "DiLoCoXConfig":
        from megatron_dilocox.config import DiLoCoXConfig
        return DiLoCoXConfig
    raise AttributeError(f"module 'megatron_dilocox' has no attribute {name!r}")
