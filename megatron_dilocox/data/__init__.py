"""Offline training data for megatron_dilocox: the King James Bible as Megatron indexed datasets.

See `megatron_dilocox.data.prepare` (CLI: `python -m megatron_dilocox.data.prepare --out DIR`).
"""
