"""Glue between DiLoCoX and Megatron-LM (the only package here that imports ``megatron``)."""
