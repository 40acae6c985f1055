"""Block-wise symmetric quantization of fp32 tensors into byte payloads.

bits=4 and 8: each block of ``block`` values shares one fp32 scale (absmax / qmax); values round to the
nearest integer in [-qmax, qmax]; int4 codes are packed two per byte. bits=1 sends the sign of each value
(eight per byte) and one scale per block, the block's mean |x|: for fixed signs that is the scale with the
least squared error, and with error feedback (the codec's e) the rest is carried to the next round, as in
EF-signSGD (Karimireddy et al., 2019). bits=16 is bf16, bits=32 is raw fp32.
Payloads are flat uint8 tensors so that every piece of a round travels in one collective, and their size
is the closed form ``payload_bytes`` (tests compare the two).

Error bound for bits 4/8: |x - dequant(quant(x))| <= absmax(block) / (2 * qmax) per element; for bits=1 the
block's squared error is sum(x^2) - n_b * mean|x|^2, n_b its real values (never more than its energy).
"""
from __future__ import annotations

import math

import torch

SCALE_BYTES = 4  # one fp32 scale per block


def qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def payload_bytes(numel: int, bits: int, block: int) -> int:
    """Exact size in bytes of ``quantize(x)`` for a tensor of ``numel`` elements."""
    if bits == 32:
        return 4 * numel
    if bits == 16:
        return 2 * numel
    data = math.ceil(numel * bits / 8)
    return data + SCALE_BYTES * math.ceil(numel / block)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def bytes_as(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a uint8 slice as ``dtype``; copies only when the slice is not aligned for it."""
    size = torch.empty(0, dtype=dtype).element_size()
    if buf.storage_offset() % size or not buf.is_contiguous():
        buf = buf.clone()
    return buf.view(dtype)


def _mean_abs(blocks: torch.Tensor, numel: int) -> torch.Tensor:
    """Per-block mean |x| over the block's real values (the zero padding of the last block not counted)."""
    scale = blocks.abs().sum(dim=1)
    counts = torch.full_like(scale, float(blocks.shape[1]))
    counts[-1] = numel - (blocks.shape[0] - 1) * blocks.shape[1]
    return scale.div_(counts)


def pack_signs(negative: torch.Tensor) -> torch.Tensor:
    """Bools, eight per byte, lowest bit first; the last byte zero-padded."""
    n = negative.numel()
    bits = negative.to(torch.uint8)
    if n % 8:
        bits = torch.cat([bits, bits.new_zeros(8 - n % 8)])
    shifts = torch.arange(8, dtype=torch.uint8, device=negative.device)  # (a factory call, like unpack_signs')
    return (bits.view(-1, 8) << shifts).sum(dim=1, dtype=torch.uint8)


def unpack_signs(data: torch.Tensor, numel: int) -> torch.Tensor:
    """+1.0 / -1.0 per value from ``pack_signs``'s bytes."""
    shifts = torch.arange(8, dtype=torch.uint8, device=data.device)
    negative = ((data[:, None] >> shifts) & 1).view(-1)[:numel]
    return 1.0 - 2.0 * negative.float()


def quantize(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Encode ``x`` (any shape, any float dtype) as a flat uint8 payload of ``payload_bytes`` bytes."""
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    if bits == 32:
        return _as_bytes(flat.clone())
    if bits == 16:
        return _as_bytes(flat.to(torch.bfloat16))
    nblocks = math.ceil(n / block)
    if n % block:  # zero-pad the last block (whole blocks, the usual case, are quantized in place of a copy)
        flat = torch.cat([flat, flat.new_zeros(nblocks * block - n)])
    blocks = flat.view(nblocks, block)
    if bits == 1:
        return torch.cat([pack_signs(flat[:n] < 0), _as_bytes(_mean_abs(blocks, n))])
    q = qmax(bits)
    scale = blocks.abs().amax(dim=1) / q
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.div(blocks, safe[:, None]).round_().clamp_(-q, q).to(torch.int16).view(-1)[:n]
    if bits == 8:
        data = codes.to(torch.int8).view(torch.uint8)
    else:  # 4 bits: offset to [1, 15], two codes per byte (low nibble first)
        nib = (codes + 8).to(torch.uint8)
        if n % 2:
            nib = torch.cat([nib, nib.new_zeros(1)])
        data = nib[0::2] | (nib[1::2] << 4)
    return torch.cat([data, _as_bytes(scale)])


def dequantize(payload: torch.Tensor, numel: int, bits: int, block: int) -> torch.Tensor:
    """Decode a payload made by ``quantize`` into a flat fp32 tensor of ``numel`` elements."""
    expected = payload_bytes(numel, bits, block)
    if payload.numel() != expected:
        raise ValueError(f"payload of {payload.numel()} bytes, expected {expected} for {numel} values at {bits} bits")
    payload = payload.contiguous()
    if bits == 32:
        return bytes_as(payload, torch.float32).clone()
    if bits == 16:
        return bytes_as(payload, torch.bfloat16).float()
    nblocks = math.ceil(numel / block)
    data_len = expected - SCALE_BYTES * nblocks
    data, scale = payload[:data_len], bytes_as(payload[data_len:], torch.float32)
    if bits == 1:
        codes = unpack_signs(data, numel)
    elif bits == 8:
        codes = bytes_as(data, torch.int8).float()
    else:
        low = (data & 0x0F).to(torch.int16) - 8
        high = (data >> 4).to(torch.int16) - 8
        codes = torch.stack([low, high], dim=1).view(-1)[:numel].float()
    if numel % block:
        codes = torch.cat([codes, codes.new_zeros(nblocks * block - numel)])
    return codes.view(nblocks, block).mul_(scale[:, None]).view(-1)[:numel]
