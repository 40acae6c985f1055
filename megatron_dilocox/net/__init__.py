"""The inter-cluster network layer: how C clusters at C sites find, authenticate and watch each other.

``rendezvous`` (the signed TCPStore handshake and its checks), ``membership`` (who is in each round,
heartbeats, the round verdicts), ``topology`` (one gloo group per local rank across clusters, built after
the rendezvous) and ``coordinator`` (the same decisions in a standalone CPU process, so that any cluster
may be lost). Pure PyTorch and ``torch.distributed``: nothing here imports Megatron, so the layer runs and
is tested without it.
"""
