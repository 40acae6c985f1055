"""Glue between DiLoCoX and Megatron-LM: the seam in Megatron's optimizer step, checkpoints, the CPU backend.

Every module here imports ``megatron`` except ``param_views`` (pure torch); outside this package only
``pretrain_gpt`` (the Megatron entry) and ``data/prepare`` (megatron-core's indexed-dataset writer) do.
``tests/test_layout.py`` pins that set. Megatron is imported inside functions, so importing these modules
stays cheap (``torch_dist`` checkpointing re-imports the ``-m`` module in a helper process).
"""
