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
The plumbing (namespaces, veth, bridge, tbf, the state file) is ``netns_link.py`` next to this file; this one
holds the testbed API, the TCP measurement and the CLI. Stdlib only; needs root, ``ip`` and ``tc`` (iproute2).
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # netns_link sits next to this file
from netns_link import (  # noqa: E402,F401  (the plumbing; FRAME .. our_namespaces re-exported for tests)
    DEFAULT_SUBNET, FRAME, GSO_SEGS, STATE_FILE, WAN_NS, WanError, _masked, _netns_list, _read_state,
    _require_root, default_burst, down, fmt_rate, gso_segs_for, kernel_hz, ns, our_namespaces, parse_rate,
    set_link, set_rate, status, up)


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
