"""Pseudo-gradient compression: low-rank with error feedback + block quantization. Pure PyTorch."""
from megatron_dilocox.compression.codec import ExchangeResult, PayloadError, PseudoGradientCodec
from megatron_dilocox.compression.collective import Collective, SoloCollective
from megatron_dilocox.compression.quantize import dequantize, payload_bytes, quantize

__all__ = ["Collective", "ExchangeResult", "PayloadError", "PseudoGradientCodec", "SoloCollective",
           "dequantize", "payload_bytes", "quantize"]
