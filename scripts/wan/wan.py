#!/usr/bin/env python3
"""Emulated WAN for C clusters on one host: one network namespace per cluster, joined by a rate-limited link.

Topology (everything lives in namespaces this tool creates; the root namespace is never touched)::

    netns dlx0: lo, wan0 10.77.0.1/24 --veth-- dlxp0 ┐
    netns dlx1: lo, wan0 10.77.0.2/24 --veth-- dlxp1 ├─ bridge dlxbr in netns dlxwan
    ...                                              ┘

All processes of cluster k run in netns ``dlxk``: among themselves they talk over 127.0.0.1 (or the
namespace's own address, which the kernel routes over ``lo`` too), unshaped. Everything that crosses
clusters goes out ``wan0`` and in through the bridge, and is shaped by a token bucket (tbf) on the
egress of *both* ends of each veth: ``wan0`` in dlxk (cluster k's uplink) and ``dlxp<k>`` in dlxwan
(cluster k's downlink). Each cluster thus has a symmetric access link of RATE; a flow from cluster i
to cluster j passes i's uplink and j's downlink, both at RATE, so it gets RATE; C-1 clusters sending
to one share that one's downlink. ``--delay MS`` adds a one-way netem delay on each downlink (so RTT
between two clusters = 2*MS); it needs sch_netem in the kernel.

CLI::

    wan.py up --clusters 2 --rate 100mbit [--delay MS] [--burst BYTES] [--latency MS | --limit BYTES]
    wan.py set-rate 10mbit [--cluster K ...]
    wan.py cut K | restore K             (cluster K's link down / up: a site's uplink failing)
    wan.py exec K -- cmd args...
    wan.py selftest --rate 50mbit [--seconds 3] [--json]
    wan.py status
    wan.py down [--kill]

Python::

    with WanTestbed(2, "100mbit") as wan:
        subprocess.run(wan.prefix(1) + ["python", "client.py", wan.addr(0)])
        wan.set_rate("10mbit")

Only one testbed per host: ``up`` first removes any ``dlx*`` state left by an earlier (killed) run.
Stdlib only; needs root, ``ip`` and ``tc`` (iproute2).
"""
from __future__ import annotations

import argparse
import gzip
import ipaddress
import json
import math
import os
import re
import signal
import socket
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


# ---------------------------------------------------------------------------------------------- API

class WanTestbed:
    """Context manager: brings the WAN up in __enter__, always tears it down in __exit__ (also on
    exceptions and KeyboardInterrupt; processes left in the namespaces are killed unless
    kill_on_exit=False)."""

    def __init__(self, clusters, rate, delay_ms=0, burst=None, latency_ms=None, limit=None,
                 subnet=DEFAULT_SUBNET, kill_on_exit=True):
        self.clusters = int(clusters)
        self.rate = rate
        self.delay_ms = delay_ms
        self.burst, self.latency_ms, self.limit = burst, latency_ms, limit
        self.subnet = ipaddress.ip_network(subnet)
        self.kill_on_exit = kill_on_exit
        self.cfg = None

    def up(self):
        self.cfg = up(self.clusters, self.rate, self.delay_ms, self.burst, self.latency_ms, self.limit,
                      str(self.subnet))
        return self

    def down(self):
        self.cfg = None
        return _masked(down, kill=self.kill_on_exit)

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()
        return False

    def addr(self, k) -> str:
        if not 0 <= k < self.clusters:
            raise IndexError(k)
        return str(self.subnet.network_address + k + 1)

    def namespace(self, k) -> str:
        return ns(k)

    def prefix(self, k):
        """Prepend to a command to run it inside cluster k."""
        if not 0 <= k < self.clusters:
            raise IndexError(k)
        return ["ip", "netns", "exec", ns(k)]

    def set_rate(self, rate, clusters=None):
        self.cfg = set_rate(rate, clusters)
        self.rate = rate

    def cut(self, k):
        set_link(k, False)

    def restore(self, k):
        set_link(k, True)

    def measure(self, src, dst, seconds=3.0, warmup=0.5):
        """TCP throughput from cluster src to cluster dst (see measure_tcp)."""
        return measure_tcp(src, dst, seconds, warmup, host=self.addr(dst))

    def measure_local(self, k, seconds=1.0, warmup=0.2, host="127.0.0.1"):
        """TCP throughput inside cluster k's namespace (loopback, unshaped)."""
        return measure_tcp(k, k, seconds, warmup, host=host)


# ---------------------------------------------------------------------------------------------- measurement

def _sink(duration, warmup, timeout):
    """Accept one TCP connection; print the port, then JSON: goodput over [first byte + warmup,
    + duration] as seen by the receiver."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", 0))
    srv.listen(1)
    srv.settimeout(timeout)
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    conn.settimeout(timeout)
    buf = bytearray(1 << 20)
    total = 0
    t_first = t_start = None
    start_bytes = 0
    now = time.monotonic()
    while True:
        n = conn.recv_into(buf)
        now = time.monotonic()
        if not n:
            break
        total += n
        if t_first is None:
            t_first = now
        elif t_start is None and now >= t_first + warmup:
            t_start, start_bytes = now, total
        elif t_start is not None and now >= t_start + duration:
            break
    mss = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)
    conn.close()
    srv.close()
    if t_start is None or now <= t_start:
        raise SystemExit("sink: stream ended before the measurement window (%d bytes)" % total)
    secs = now - t_start
    print(json.dumps({"bytes": total - start_bytes, "seconds": secs,
                      "goodput_bps": (total - start_bytes) * 8 / secs, "mss": mss}), flush=True)


def _source(host, port, max_seconds):
    s = socket.create_connection((host, port), timeout=10)
    buf = b"\0" * (256 << 10)
    deadline = time.monotonic() + max_seconds
    try:
        while time.monotonic() < deadline:
            s.sendall(buf)
    except OSError:  # the sink closed: done
        pass
    finally:
        s.close()


def measure_tcp(src, dst, seconds=3.0, warmup=0.5, host=None):
    """One TCP stream from a process in netns dlx<src> to a sink in netns dlx<dst>; returns the
    receiver-side goodput (TCP payload) and an estimate of the on-wire rate (what tbf counts:
    payload + TCP/IP/timestamp/Ethernet headers)."""
    me = os.path.abspath(__file__)
    if host is None:
        cfg = _read_state() or {"subnet": DEFAULT_SUBNET}
        host = str(ipaddress.ip_network(cfg["subnet"]).network_address + dst + 1)
    timeout = seconds + warmup + 30
    sink = subprocess.Popen(["ip", "netns", "exec", ns(dst), sys.executable, me, "_sink",
                             "--seconds", str(seconds), "--warmup", str(warmup), "--timeout", str(timeout)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    source = None
    try:
        port = sink.stdout.readline().strip()
        if not port.isdigit():
            raise WanError("sink did not start: %s" % sink.stderr.read())
        source = subprocess.Popen(["ip", "netns", "exec", ns(src), sys.executable, me, "_source",
                                   "--host", host, "--port", port, "--max-seconds", str(timeout)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        out, err = sink.communicate(timeout=timeout + 10)
        if sink.returncode != 0:
            raise WanError("sink failed: %s %s" % (err.strip(), source.stderr.read() if source.poll()
                                                    is not None else ""))
        res = json.loads(out.strip().splitlines()[-1])
        source.wait(timeout=15)
    finally:
        for p in (source, sink):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    hdr = 20 + 20 + 12 + 14  # IPv4 + TCP + timestamp option + Ethernet (mss excludes the options)
    res["wire_bps"] = res["goodput_bps"] * (res["mss"] + hdr) / res["mss"]
    res.update(src=src, dst=dst, host=host)
    return res


def selftest(rate=None, clusters=2, seconds=3.0, delay_ms=0.0, out=sys.stdout):
    """Bring the testbed up if it is not (and take it down again afterwards); measure cluster 1 ->
    cluster 0 over the shaped link and cluster 0's loopback. If the testbed was already up and
    rate is given, that rate is set for the measurement and the previous one restored afterwards."""
    _require_root()
    cfg = _read_state() if WAN_NS in _netns_list() else None
    ours = cfg is None
    restore = None
    if ours:
        if rate is None:
            raise WanError("testbed not up: selftest needs --rate")
        cfg = up(max(2, clusters), rate, delay_ms)
    elif cfg["clusters"] < 2:
        raise WanError("selftest needs a testbed with >= 2 clusters")
    elif rate is not None and (parse_rate(rate) != cfg["rate_bits"] or len(set(cfg["rates"].values())) > 1):
        restore = dict(cfg["rates"])
        cfg = set_rate(rate)
    try:
        shaped = measure_tcp(1, 0, seconds)
        conf = min(cfg["rates"]["1"], cfg["rates"]["0"])  # cluster 1's uplink, then cluster 0's downlink
        local = measure_tcp(0, 0, 1.0, 0.2, host="127.0.0.1")
        local_addr = measure_tcp(0, 0, 1.0, 0.2,
                                 host=str(ipaddress.ip_network(cfg["subnet"]).network_address + 1))
        res = {"configured_bps": conf, "achieved_goodput_bps": shaped["goodput_bps"],
               "achieved_wire_bps": shaped["wire_bps"], "ratio": shaped["goodput_bps"] / conf,
               "wire_ratio": shaped["wire_bps"] / conf, "mss": shaped["mss"],
               "loopback_bps": local["goodput_bps"], "own_addr_bps": local_addr["goodput_bps"],
               "loopback_speedup": local["goodput_bps"] / shaped["goodput_bps"],
               "own_addr_speedup": local_addr["goodput_bps"] / shaped["goodput_bps"],
               "seconds": shaped["seconds"], "kernel_hz": kernel_hz(),
               "burst": cfg["burst"] or default_burst(conf)}
    finally:
        if ours:
            _masked(down)
        elif restore is not None:
            for k, r in restore.items():
                set_rate(r, [int(k)])
    if out is not None:
        print("wan selftest: cluster 1 -> cluster 0 over the shaped link (%.1f s, one TCP stream)"
              % res["seconds"], file=out)
        print("  configured %s, achieved %s goodput (ratio %.3f), ~%s on the wire incl. headers "
              "(ratio %.3f)" % (fmt_rate(conf), fmt_rate(res["achieved_goodput_bps"]), res["ratio"],
                                fmt_rate(res["achieved_wire_bps"]), res["wire_ratio"]), file=out)
        print("  inside cluster 0: 127.0.0.1 %s (%.0fx), own address %s (%.0fx): unshaped"
              % (fmt_rate(res["loopback_bps"]), res["loopback_speedup"], fmt_rate(res["own_addr_bps"]),
                 res["own_addr_speedup"]), file=out)
    return res


# ---------------------------------------------------------------------------------------------- CLI

def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "exec":  # wan.py exec K -- cmd ...   (no argparse: keep cmd's flags intact)
        rest = argv[1:]
        if len(rest) < 2 or not rest[0].isdigit():
            raise SystemExit("usage: wan.py exec K -- cmd [args...]")
        k, cmd = int(rest[0]), rest[1:]
        if cmd and cmd[0] == "--":
            cmd = cmd[1:]
        if not cmd:
            raise SystemExit("usage: wan.py exec K -- cmd [args...]")
        if ns(k) not in _netns_list():
            raise SystemExit("wan: netns %s does not exist (wan.py up ...)" % ns(k))
        os.execvp("ip", ["ip", "netns", "exec", ns(k)] + cmd)

    ap = argparse.ArgumentParser(prog="wan.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("up", help="create the testbed (tears down stale state first)")
    p.add_argument("--clusters", type=int, required=True)
    p.add_argument("--rate", required=True, help="per cluster link, each direction, e.g. 100mbit")
    p.add_argument("--delay", type=float, default=0.0, help="one-way delay in ms (netem; RTT = 2x)")
    p.add_argument("--burst", type=int, default=None, help="tbf bucket in bytes (default max(rate/HZ, 4 frames))")
    q = p.add_mutually_exclusive_group()
    q.add_argument("--latency", type=float, default=None, help="tbf queue as ms at rate (default max(50, 2*delay))")
    q.add_argument("--limit", type=int, default=None, help="tbf queue in bytes (instead of --latency)")
    p.add_argument("--subnet", default=DEFAULT_SUBNET)
    p = sub.add_parser("down", help="remove everything (idempotent)")
    p.add_argument("--kill", action="store_true", help="also kill processes still in the namespaces")
    p = sub.add_parser("set-rate", help="change the rate live")
    p.add_argument("rate")
    p.add_argument("--cluster", type=int, action="append", help="only this cluster's link (repeatable)")
    for verb in ("cut", "restore"):
        p = sub.add_parser(verb, help="%s cluster K's link (all its packets dropped / flowing again)" % verb)
        p.add_argument("cluster", type=int)
    sub.add_parser("status")
    sub.add_parser("exec", help="exec K -- cmd...: run cmd in cluster K's namespace")
    p = sub.add_parser("selftest", help="measure the shaped link and loopback")
    p.add_argument("--rate", default=None)
    p.add_argument("--clusters", type=int, default=2)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("_sink")
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--warmup", type=float, required=True)
    p.add_argument("--timeout", type=float, required=True)
    p = sub.add_parser("_source")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-seconds", type=float, required=True)
    a = ap.parse_args(argv)

    try:
        if a.cmd == "up":
            up(a.clusters, a.rate, a.delay, a.burst, a.latency, a.limit, a.subnet, verbose=True)
        elif a.cmd == "down":
            _require_root()
            left = _masked(down, kill=a.kill, verbose=True)
            return 1 if left else 0
        elif a.cmd == "set-rate":
            set_rate(a.rate, a.cluster, verbose=True)
        elif a.cmd in ("cut", "restore"):
            set_link(a.cluster, a.cmd == "restore")
            print("wan: cluster %d link %s" % (a.cluster, "restored" if a.cmd == "restore" else "cut"))
        elif a.cmd == "status":
            print(status())
        elif a.cmd == "selftest":
            res = selftest(a.rate, a.clusters, a.seconds, a.delay, out=None if a.json else sys.stdout)
            if a.json:
                print(json.dumps(res))
        elif a.cmd == "_sink":
            _sink(a.seconds, a.warmup, a.timeout)
        elif a.cmd == "_source":
            _source(a.host, a.port, a.max_seconds)
    except WanError as e:
        print("wan: error: %s" % e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
