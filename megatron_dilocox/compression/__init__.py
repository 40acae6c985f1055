"""Pseudo-gradient compression: low-rank with error feedback + block quantization, and the sparse exchange. Pure
PyTorch. The names below are imported on first use, so that ``sparse_form`` (no torch) can be imported alone, by the
cost model."""
import importlib

_WHERE = {"ExchangeResult": "codec", "PayloadError": "codec", "PseudoGradientCodec": "codec",
          "Collective": "collective", "SoloCollective": "collective",
          "dequantize": "quantize", "payload_bytes": "quantize"}  # (not ``quantize``: also the submodule's name)

__all__ = sorted(_WHERE)


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
