"""Block quantization: exact byte counts, exact int4 and sign packing, the error bound absmax/(2*qmax), and the
1-bit scale that minimises the squared error."""
import math

import pytest
import torch

from megatron_dilocox.compression.quantize import dequantize, payload_bytes, qmax, quantize

pytestmark = pytest.mark.unit


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
    assert payload_bytes(1000, 1, 128) == 125 + 4 * 8
    assert payload_bytes(1001, 1, 128) == 126 + 4 * 8


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


def test_sign_codes_are_packed_eight_per_byte_lowest_bit_first_and_scaled_by_the_block_mean_abs():
    x = torch.tensor([1.0, -2.0, 3.0, -4.0, 0.0, 6.0, -7.0, 8.0, -9.0, 10.0])  # 0 counts as positive
    payload = quantize(x, 1, 4)  # blocks [1,-2,3,-4] [0,6,-7,8] [-9,10] (the last one padded)
    assert payload.numel() == payload_bytes(10, 1, 4) == 2 + 4 * 3
    assert payload[:2].tolist() == [0b01001010, 0b01]
    assert payload[2:].clone().view(torch.float32).tolist() == [2.5, 5.25, 9.5]  # mean |x| of the real values
    assert dequantize(payload, 10, 1, 4).tolist() == [2.5, -2.5, 2.5, -2.5, 5.25, 5.25, -5.25, 5.25, -9.5, 9.5]


@pytest.mark.parametrize("numel,block", [(1, 2), (7, 4), (1000, 128), (4097, 64)])
def test_sign_scale_is_the_least_squares_one_and_the_error_is_its_closed_form(numel, block):
    """For fixed signs s, min_a ||x - a s||^2 is at a = mean|x|, leaving sum x^2 - n a^2 per block."""
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 2, numel)
    y = dequantize(quantize(x, 1, block), numel, 1, block)
    for start in range(0, numel, block):
        xb, yb = x[start:start + block].double(), y[start:start + block].double()
        a = xb.abs().mean()
        assert torch.allclose(yb.abs(), a.expand_as(yb).float().double(), rtol=1e-6)
        assert torch.allclose((xb - yb).pow(2).sum(), xb.pow(2).sum() - len(xb) * a * a, rtol=1e-4, atol=1e-9)
        for other in (0.9 * a, 1.1 * a):  # any other scale is worse
            assert (xb - yb * other / a).pow(2).sum() > (xb - yb).pow(2).sum()
