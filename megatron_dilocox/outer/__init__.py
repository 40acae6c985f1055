"""The outer loop: the DiLoCoX round (``sync``), its streaming form (``streaming``), the outer optimizer
(``nesterov``), the round plan (``plan``, ``link``), resume and rejoin (``resume``, ``handover``) and the
per-round metrics (``report``). Pure PyTorch: nothing here imports Megatron.

(This file also makes ``find_packages`` ship the package in a non-editable install, e.g. the Docker image.)
"""
