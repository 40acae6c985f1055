"""megatron_dilocox: DiLoCoX (decentralized low-communication training) as a Megatron-LM plugin.

The core (``config``, ``compression/``, ``outer/``, ``topology``, ``metrics``) is pure PyTorch; only
``arguments`` (flag parsing, no Megatron import), ``glue/`` and ``pretrain_gpt`` touch Megatron.
"""
__version__ = "0.1.0"
