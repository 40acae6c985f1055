"""Single-host harnesses: run C clusters on one machine, for experiments, the tests and the main job.

``launch`` starts C ``torchrun`` worlds running real Megatron (``python -m megatron_dilocox.launch``);
``spawn`` starts C gloo worlds of plain Python functions via multiprocessing (the core tests);
``main_job`` is the main job (``python -m megatron_dilocox.main_job``) and ``plot`` draws its loss curves.
A real multi-site run does not use this package: each site starts its own ``torchrun ... -m
megatron_dilocox.pretrain_gpt`` (``scripts/pretrain_gpt_dilocox.sh`` under SLURM).
"""
