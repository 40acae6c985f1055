"""The sparse exchange's wire form, with no torch import: how tensors are cut into chunks and what a payload
weighs. The codec (``sparse.py``), the config's checks and the cost model (``sim/cost_model.py``) share it, so the
bytes the planner prices are the bytes the run sends (docs/algorithm.md#sparse-exchange)."""
from __future__ import annotations

LEVELS = 4  # magnitudes per chunk: one per run of places in decreasing |M|
INDEX_BYTES = 2  # an entry's place in its chunk, int16
MAX_CHUNK = 1 << 15  # the largest chunk whose places fit in int16


def pieces(numels, k: int, chunk: int) -> list[tuple[int, int, int, int]]:
    """(slab offset, rows, row length, entries per row) of tensors of ``numels`` values laid end to end: each
    tensor's full chunks as one piece, then its shorter last chunk (if any) as another."""
    out, offset = [], 0
    for n in numels:
        full, tail = divmod(int(n), chunk)
        for rows, length in ((full, chunk), (1 if tail else 0, tail)):
            if rows:
                out.append((offset, rows, length, min(k, length)))
                offset += rows * length
    return out


def run_bounds(kk: int) -> list[int]:
    """Where each run of places starts (and the last ends): place j is in run ⌊LEVELS·j/kk⌋."""
    return [-(-r * kk // LEVELS) for r in range(LEVELS + 1)]


def bytes_of(cut: list[tuple[int, int, int, int]]) -> int:
    """Bytes of one site's payload over ``pieces``' cut: per entry its index and a sign bit, per chunk LEVELS fp32
    magnitudes."""
    entries = sum(rows * kk for _, rows, _, kk in cut)
    chunks = sum(rows for _, rows, _, _ in cut)
    return INDEX_BYTES * entries + -(-entries // 8) + 4 * LEVELS * chunks


def payload_bytes(numels, k: int, chunk: int) -> int:
    """Bytes of one site's payload for tensors of ``numels`` values."""
    return bytes_of(pieces(numels, k, chunk))
