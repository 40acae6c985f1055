"""What authenticating payloads costs (compression/auth.py): HMAC-SHA256 throughput on this machine, and the
tag's time as a share of the same bytes' transfer at a link rate.

Every byte a cluster sends is tagged once and every byte it receives is verified once, in the exchange's
background thread; so per round the tag work is (sent + received) / rate, against sent / link rate on the wire.

    .venv/bin/python scripts/bench/tag_cost.py [--mib 64] [--repeats 5] [--gbps 1]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from megatron_dilocox.compression.auth import derive_key, tag  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gbps", type=float, default=1.0)
    a = ap.parse_args(argv)
    key = derive_key("benchmark-secret", "session/e0")
    payload = torch.randint(0, 256, (a.mib << 20,), dtype=torch.uint8)
    tag(key, (1, 0, "warm-up"), 0, -1, payload[:1 << 20])
    best = min(_timed(lambda: tag(key, (1, 0, "payload"), 0, -1, payload)) for _ in range(a.repeats))
    rate = payload.numel() / best
    link = a.gbps * 1e9 / 8
    share = 2 * link / rate  # tag what it sends + verify what it receives, per byte on the wire
    print(f"HMAC-SHA256 over {a.mib} MiB: {best * 1e3:.1f} ms, {rate / 1e6:.0f} MB/s on one core")
    print(f"at {a.gbps:g} Gbit/s ({link / 1e6:.0f} MB/s on the wire): sealing and verifying every byte takes "
          f"{100 * share:.1f}% of its transfer time (in the exchange thread, beside the transfer)")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
