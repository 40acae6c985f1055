"""The emulated WAN's network plumbing: namespaces, veth pairs, the bridge and the tbf/netem shaping,
and the state file that lets ``down``/``set-rate`` find them again. ``wan.py`` builds the testbed API,
the TCP measurement and the CLI on top of this; see its docstring for the topology.

Stdlib only; needs root, ``ip`` and ``tc`` (iproute2).
"""
from __future__ import annotations

import gzip
import ipaddress
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

PREFIX = "dlx"
WAN_NS = PREFIX + "wan"          # holds the bridge
BRIDGE = PREFIX + "br"
CLUSTER_DEV = "wan0"             # cluster-side veth, inside dlx<k>
DEFAULT_SUBNET = "10.77.0.0/24"
STATE_DIR = Path("/run/dlxwan")
STATE_FILE = STATE_DIR / "state.json"
MTU = 1500
FRAME = MTU + 14                 # what tbf counts for a full-size packet (skb->len includes the Ethernet header)
GSO_SEGS = 4                     # gso_max_segs on the cluster-side veth: no skb on the shaped path exceeds 4 frames
MIN_BURST = (GSO_SEGS + 1) * FRAME  # >= the largest skb, with a frame of slack for tc's rounding of burst to time
DEFAULT_LATENCY_MS = 50.0
_NS_RE = re.compile(r"^%s(\d+|wan)$" % PREFIX)


class WanError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------- helpers

def _run(cmd, check=True, quiet=False):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and p.returncode != 0:
        raise WanError("%s failed (rc %d): %s" % (" ".join(cmd), p.returncode, p.stderr.strip()))
    return p


_RATE_UNITS = {  # -> bits per second
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 1024, "mibit": 1024 ** 2, "gibit": 1024 ** 3, "tibit": 1024 ** 4,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,  # tc: "bps" means BYTES per second
    "kibps": 8 * 1024, "mibps": 8 * 1024 ** 2, "gibps": 8 * 1024 ** 3,
}


def parse_rate(rate) -> int:
    """tc rate syntax (``100mbit``, ``1gbit``, ``500kbit``, ``10mbps`` = 10 MBytes/s) -> bits/s.
    A bare number is bits/s. Numbers (int/float) are taken as bits/s."""
    if isinstance(rate, (int, float)):
        bits = float(rate)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*([A-Za-z]*)\s*", str(rate))
        if not m:
            raise WanError("bad rate %r (use e.g. 100mbit, 1gbit, 500kbit)" % (rate,))
        unit = m.group(2).lower() or "bit"
        if unit not in _RATE_UNITS:
            raise WanError("bad rate unit %r in %r (one of %s)" % (unit, rate, ", ".join(_RATE_UNITS)))
        bits = float(m.group(1)) * _RATE_UNITS[unit]
    if bits < 8000:
        raise WanError("rate %r too low (minimum 8kbit)" % (rate,))
    return int(round(bits))


def fmt_rate(bits: float) -> str:
    for unit, f in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= f:
            return "%.2f %s" % (bits / f, unit)
    return "%.0f bit/s" % bits


_HZ = None


def kernel_hz() -> int:
    """CONFIG_HZ of the running kernel (from /proc/config.gz or /boot/config-*), else 100: the smallest
    HZ Linux offers, so rate/100 is a burst that satisfies burst >= rate/HZ on every kernel."""
    global _HZ
    if _HZ is None:
        _HZ = 100
        text = None
        try:
            text = gzip.open("/proc/config.gz", "rt").read()
        except OSError:
            try:
                text = Path("/boot/config-" + os.uname().release).read_text()
            except OSError:
                pass
        m = re.search(r"^CONFIG_HZ=(\d+)$", text or "", re.M)
        if m:
            _HZ = int(m.group(1))
    return _HZ


def default_burst(rate_bits: int) -> int:
    """Bucket size in bytes: max(rate/HZ, MIN_BURST). See README ("burst and queue")."""
    return max(int(math.ceil(rate_bits / 8 / kernel_hz())), MIN_BURST)


def gso_segs_for(burst) -> int:
    """Largest GSO skb (in segments) that a bucket of `burst` bytes always holds (one frame of slack)."""
    return GSO_SEGS if burst is None else max(1, min(GSO_SEGS, int(burst) // FRAME - 1))


def _netns_list():
    p = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def our_namespaces():
    return sorted(n for n in _netns_list() if _NS_RE.match(n))


def ns(k) -> str:
    return "%s%d" % (PREFIX, k)


def port_dev(k) -> str:
    return "%sp%d" % (PREFIX, k)


def _require_root():
    if os.geteuid() != 0:
        raise WanError("needs root (network namespaces, veth, tc)")
    for tool in ("ip", "tc"):
        if _run(["sh", "-c", "command -v " + tool], check=False).returncode != 0:
            raise WanError("%s (iproute2) not found" % tool)


# ---------------------------------------------------------------------------------------------- shaping

def _tbf_args(rate_bits, burst, latency_ms, limit):
    args = ["tbf", "rate", "%dbit" % rate_bits, "burst", str(burst)]
    if limit is not None:
        args += ["limit", str(int(limit))]
    else:
        args += ["latency", "%gms" % latency_ms]
    return args


def _shape_dev(netns, dev, cfg, rate_bits, delay_ms, replace):
    """Root qdisc on one egress: tbf, or netem delay (root 1:) with tbf as its child (1:1 -> 10:)."""
    burst = cfg["burst"] if cfg.get("burst") else default_burst(rate_bits)
    tbf = _tbf_args(rate_bits, burst, cfg["latency_ms"], cfg.get("limit"))
    verb = "replace" if replace else "add"
    if delay_ms:
        if not replace:
            # The delay line must hold rate*delay bytes; netem's limit is in packets.
            pkts = max(1000, int(2 * rate_bits / 8 * delay_ms / 1000 / FRAME) + 1)
            p = _run(["tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                      "delay", "%gms" % delay_ms, "limit", str(pkts)], check=False)
            if p.returncode != 0:
                raise WanError("netem delay failed on %s/%s (is sch_netem in this kernel? "
                               "CONFIG_NET_SCH_NETEM): %s" % (netns, dev, p.stderr.strip()))
        _run(["tc", "-n", netns, "qdisc", verb, "dev", dev, "parent", "1:1", "handle", "10:"] + tbf)
    else:
        _run(["tc", "-n", netns, "qdisc", verb, "dev", dev, "root", "handle", "1:"] + tbf)


# ---------------------------------------------------------------------------------------------- state

def _read_state():
    try:
        return json.loads(STATE_FILE.read_text())
    except (OSError, ValueError):
        return None


def _write_state(cfg):
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = STATE_FILE.with_suffix(".tmp")
    tmp.write_text(json.dumps(cfg, indent=1))
    tmp.replace(STATE_FILE)


def is_up() -> bool:
    return WAN_NS in _netns_list() and _read_state() is not None


# ---------------------------------------------------------------------------------------------- up / down

def down(kill=False, verbose=False):
    """Remove every dlx* namespace (ours, or stale from a killed run), the links in them and the state
    file. Links are deleted explicitly first, so a process still inside a namespace is cut off even
    though the (then anonymous) namespace lives on until it exits; kill=True also terminates such
    processes (SIGTERM, then SIGKILL after 3 s). Idempotent. Returns the pids left running."""
    names = our_namespaces()
    cluster_ns = [n for n in names if n != WAN_NS]
    leftover = []
    for n in names:
        pids = [int(x) for x in _run(["ip", "netns", "pids", n], check=False).stdout.split()]
        pids = [p for p in pids if p != os.getpid()]
        if pids and kill:
            _kill(pids)
            pids = [p for p in pids if _alive(p)]
        if pids:
            leftover += pids
            print("wan: warning: processes %s still run in netns %s; their namespace is cut off and "
                  "goes when they exit (use down --kill)" % (pids, n), file=sys.stderr)
    for n in cluster_ns:  # deleting one end of a veth deletes its peer in dlxwan too
        _run(["ip", "-n", n, "link", "del", CLUSTER_DEV], check=False)
    if WAN_NS in names:
        for dev in _run(["ip", "-n", WAN_NS, "-o", "link", "show"], check=False).stdout.splitlines():
            m = re.match(r"\d+:\s+([^:@\s]+)", dev)
            if m and m.group(1) != "lo":
                _run(["ip", "-n", WAN_NS, "link", "del", m.group(1)], check=False)
    for n in names:
        p = _run(["ip", "netns", "del", n], check=False)
        if p.returncode != 0 and n in _netns_list():
            raise WanError("could not delete netns %s: %s" % (n, p.stderr.strip()))
        if verbose:
            print("wan: deleted netns", n)
    for f in (STATE_FILE, STATE_FILE.with_suffix(".tmp")):
        try:
            f.unlink()
        except FileNotFoundError:
            pass
    try:
        STATE_DIR.rmdir()
    except OSError:
        pass
    return leftover


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours counts as gone
        return Path("/proc/%d/stat" % pid).read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _kill(pids):
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.05)
        if not any(_alive(p) for p in pids):
            return


def up(clusters, rate, delay_ms=0.0, burst=None, latency_ms=None, limit=None, subnet=DEFAULT_SUBNET,
       verbose=False):
    """Create the testbed (tearing down stale state first). On any failure, or Ctrl-C, what was
    created is removed again before the exception propagates."""
    _require_root()
    clusters = int(clusters)
    net = ipaddress.ip_network(subnet)
    if clusters < 1 or clusters > net.num_addresses - 2:
        raise WanError("clusters must be in 1..%d for subnet %s" % (net.num_addresses - 2, subnet))
    rate_bits = parse_rate(rate)
    if burst is not None and int(burst) < 2 * FRAME:
        raise WanError("burst %s < two full frames (%d bytes): tbf would stall or drop full-size packets"
                       % (burst, 2 * FRAME))
    if latency_ms is None and limit is None:  # a queue of >= one RTT (2*delay) at the rate, at least 50 ms
        latency_ms = max(DEFAULT_LATENCY_MS, 2.0 * float(delay_ms or 0))
    cfg = {"clusters": clusters, "rate_bits": rate_bits, "delay_ms": float(delay_ms or 0),
           "burst": int(burst) if burst else None, "gso_max_segs": gso_segs_for(burst), "latency_ms": latency_ms,
           "limit": int(limit) if limit is not None else None, "subnet": str(net),
           "rates": {str(k): rate_bits for k in range(clusters)}}
    down()
    try:
        _up(cfg, net, verbose)
    except BaseException:
        _masked(down)
        raise
    return cfg


def _up(cfg, net, verbose):
    ip = lambda n, *a: _run(["ip", "-n", n] + list(a))  # noqa: E731
    _run(["ip", "netns", "add", WAN_NS])
    ip(WAN_NS, "link", "set", "lo", "up")
    ip(WAN_NS, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0", "forward_delay", "0")
    ip(WAN_NS, "link", "set", BRIDGE, "addrgenmode", "none")
    ip(WAN_NS, "link", "set", BRIDGE, "up")
    for k in range(cfg["clusters"]):
        n = ns(k)
        _run(["ip", "netns", "add", n])
        ip(n, "link", "set", "lo", "up")
        ip(n, "link", "add", CLUSTER_DEV, "mtu", str(MTU), "type", "veth",
           "peer", "name", port_dev(k), "netns", WAN_NS)
        # addrgenmode none: no IPv6 link-local address, hence no DAD/RS/MLD chatter on the shaped link
        ip(n, "link", "set", CLUSTER_DEV, "addrgenmode", "none")
        # The stack of cluster k builds skbs for wan0 of at most gso_max_segs segments, so every skb
        # on the shaped path (both tbfs) fits the bucket, at any rate set-rate may choose later.
        ip(n, "link", "set", CLUSTER_DEV, "gso_max_segs", str(cfg["gso_max_segs"]))
        ip(WAN_NS, "link", "set", port_dev(k), "addrgenmode", "none")
        ip(WAN_NS, "link", "set", port_dev(k), "master", BRIDGE)
        ip(n, "addr", "add", "%s/%d" % (net.network_address + k + 1, net.prefixlen), "dev", CLUSTER_DEV)
        _shape_dev(n, CLUSTER_DEV, cfg, cfg["rate_bits"], 0, replace=False)                # uplink
        _shape_dev(WAN_NS, port_dev(k), cfg, cfg["rate_bits"], cfg["delay_ms"], replace=False)  # downlink
        ip(WAN_NS, "link", "set", port_dev(k), "up")
        ip(n, "link", "set", CLUSTER_DEV, "up")
    _write_state(cfg)
    if verbose:
        print("wan: up: %d clusters in %s, %s per cluster link%s, burst %d B, %s"
              % (cfg["clusters"], net, fmt_rate(cfg["rate_bits"]),
                 ", delay %g ms one-way" % cfg["delay_ms"] if cfg["delay_ms"] else "",
                 cfg["burst"] or default_burst(cfg["rate_bits"]),
                 "limit %d B" % cfg["limit"] if cfg["limit"] is not None else
                 "latency %g ms" % cfg["latency_ms"]))


def set_rate(rate, clusters=None, verbose=False):
    """Change the rate live (tc qdisc replace on the existing handles; links, addresses and open
    connections stay). clusters: which clusters' links (default all)."""
    _require_root()
    cfg = _read_state()
    if cfg is None or WAN_NS not in _netns_list():
        raise WanError("testbed is not up (wan.py up ...)")
    rate_bits = parse_rate(rate)
    ks = range(cfg["clusters"]) if clusters is None else [int(k) for k in clusters]
    for k in ks:
        if not 0 <= k < cfg["clusters"]:
            raise WanError("no cluster %d (testbed has %d)" % (k, cfg["clusters"]))
        _shape_dev(ns(k), CLUSTER_DEV, cfg, rate_bits, 0, replace=True)
        _shape_dev(WAN_NS, port_dev(k), cfg, rate_bits, cfg["delay_ms"], replace=True)
        cfg["rates"][str(k)] = rate_bits
    if len(set(cfg["rates"].values())) == 1:
        cfg["rate_bits"] = rate_bits
    _write_state(cfg)
    if verbose:
        print("wan: rate %s on cluster links %s" % (fmt_rate(rate_bits), list(ks)))
    return cfg


def set_link(k, up_: bool):
    """Cut (or restore) cluster k's link: its bridge port goes down, so every packet to or from it is
    dropped while its sockets stay open, as when a site's uplink fails."""
    _require_root()
    cfg = _read_state()
    if cfg is None or not 0 <= int(k) < cfg["clusters"]:
        raise WanError("testbed is not up, or it has no cluster %s" % k)
    _run(["ip", "-n", WAN_NS, "link", "set", port_dev(int(k)), "up" if up_ else "down"])


def status():
    cfg = _read_state()
    lines = ["namespaces: %s" % (" ".join(our_namespaces()) or "(none)")]
    if cfg:
        lines.append("config: %s" % json.dumps(cfg))
        for k in range(cfg["clusters"]):
            for n, dev in ((ns(k), CLUSTER_DEV), (WAN_NS, port_dev(k))):
                q = _run(["tc", "-n", n, "qdisc", "show", "dev", dev], check=False).stdout.strip()
                lines.append("%s/%s: %s" % (n, dev, q.replace("\n", " | ")))
    return "\n".join(lines)


def _masked(fn, *a, **kw):
    """Run fn with SIGINT blocked (main thread), so a second Ctrl-C cannot interrupt a tear-down."""
    blocked = False
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        blocked = True
    except (AttributeError, ValueError, OSError):
        pass
    try:
        return fn(*a, **kw)
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
