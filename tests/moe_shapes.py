"""The shapes of tests/test_moe.py's tiny models, counted by hand, and the planner's ``Setup`` of its MoE GPT.

One place for both sides: the real Megatron runs (tests/test_moe.py) and the planner (tests/test_sim_moe.py) are
checked against the same counts, so a change to the model's shape cannot leave one of them behind.
"""
from megatron_dilocox.sim.cost_model import Setup

HIDDEN, FFN, VOCAB, EXPERTS, LAYERS = 64, 256, 4096, 4, 2

# the MoE GPT: 2 layers, hidden 64, FFN 256, 4 experts top-2, biases, tied; EP2 x DP2, distributed optimizer
TINY_MOE = Setup(hidden=HIDDEN, layers=LAYERS, ffn=FFN, vocab=VOCAB, heads=4, swiglu=False, tied_embeddings=True,
                 bias=True, clusters=2, tp=1, pp=1, dp=4, distributed_optimizer=True, experts=EXPERTS, topk=2, ep=2,
                 rank=4, bits=4, block=64, min_dim=32)


def moe_param_counts():
    """(dense, expert, router) element counts of the MoE GPT: tied embedding, LayerNorms with bias, biased linears."""
    attention = (3 * HIDDEN * HIDDEN + 3 * HIDDEN) + (HIDDEN * HIDDEN + HIDDEN) + 2 * 2 * HIDDEN  # qkv, proj, 2 LNs
    dense = VOCAB * HIDDEN + LAYERS * attention + 2 * HIDDEN
    expert = LAYERS * EXPERTS * ((FFN * HIDDEN + FFN) + (HIDDEN * FFN + HIDDEN))
    router = LAYERS * (EXPERTS * HIDDEN + EXPERTS)
    return dense, expert, router


def dense_107b_count():
    """The dense GPT's element count: GQA (4 heads, 2 groups of 16), SwiGLU fc1 [2F, H] with Megatron's
    F = 64 * int(8H/3 / 64) = 128, RMSNorm (weight only), no biases, untied output layer."""
    kv, ffn = 2 * 2 * (HIDDEN // 4), 64 * int(8 * HIDDEN / 3 / 64)
    layer = HIDDEN * (HIDDEN + kv) + HIDDEN * HIDDEN + 2 * ffn * HIDDEN + HIDDEN * ffn + 2 * HIDDEN
    return 2 * VOCAB * HIDDEN + LAYERS * layer + HIDDEN
