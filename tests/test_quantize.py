"""Block quantization: exact byte counts, exact int4 packing, and the error bound absmax/(2*qmax)."""
import math

import pytest
import torch

from megatron_dilocox.compression.quantize import dequantize, payload_bytes, qmax, quantize


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("numel,block", [(1, 2), (7, 4), (1000, 128), (4097, 64), (65536, 256)])
def test_roundtrip_error_within_block_bound(bits, numel, block):
    g = torch.Generator().manual_seed(numel + bits)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 2, numel)  # blocks of very different scale
    payload = quantize(x, bits, block)
    assert payload.dtype == torch.uint8 and payload.numel() == payload_bytes(numel, bits, block)
    y = dequantize(payload, numel, bits, block)
    pad = math.ceil(numel / block) * block - numel
    blocks = torch.cat([x, x.new_zeros(pad)]).view(-1, block)
    bound = (blocks.abs().amax(dim=1, keepdim=True) / (2 * qmax(bits))).expand(-1, block).reshape(-1)[:numel]
    err = (x - y).abs()
    # round-to-nearest: at most half a quantization step, plus fp32 rounding of the scale product
    assert bool((err <= bound * (1 + 1e-6) + 1e-12).all()), float((err - bound).max())


def test_byte_formula_closed_form():
    assert payload_bytes(1000, 4, 128) == 500 + 4 * 8
    assert payload_bytes(1001, 4, 128) == 501 + 4 * 8
    assert payload_bytes(1000, 8, 100) == 1000 + 4 * 10
    assert payload_bytes(1000, 16, 128) == 2000
    assert payload_bytes(1000, 32, 128) == 4000


def test_int4_codes_are_packed_two_per_byte_low_nibble_first():
    x = torch.tensor([7.0, -7.0, 0.0, 1.0, -1.0])  # block absmax 7 -> scale 1, codes are the values
    payload = quantize(x, 4, 6)
    data = payload[:3].tolist()
    assert data == [(7 + 8) | ((-7 + 8) << 4), (0 + 8) | ((1 + 8) << 4), (-1 + 8)]
    assert payload[3:].clone().view(torch.float32).tolist() == [1.0]
    assert dequantize(payload, 5, 4, 6).tolist() == x.tolist()


@pytest.mark.parametrize("bits", [16, 32])
def test_float_payloads(bits):
    x = torch.randn(333)
    y = dequantize(quantize(x, bits, 64), 333, bits, 64)
    if bits == 32:
        assert torch.equal(x, y)
    else:
        assert torch.equal(y, x.to(torch.bfloat16).float())


def test_zero_block_and_wrong_size_payload():
    assert torch.equal(dequantize(quantize(torch.zeros(10), 8, 4), 10, 8, 4), torch.zeros(10))
    with pytest.raises(ValueError, match="payload of 5 bytes, expected 22"):
        dequantize(torch.zeros(5, dtype=torch.uint8), 10, 8, 4)
