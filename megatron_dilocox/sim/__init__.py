"""Cost model and planner for DiLoCoX vs AllReduce and DiLoCo (pure Python: no torch, no megatron).

``python -m megatron_dilocox.sim --help``; ``--paper`` for the Qi et al. (2025) setup.
"""
from megatron_dilocox.sim.cost_model import payload_bytes, plan, predict, rank_payload
from megatron_dilocox.sim.setup import Setup, model_params

__all__ = ["Setup", "model_params", "payload_bytes", "plan", "predict", "rank_payload"]
