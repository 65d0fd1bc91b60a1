"""A link emulated by the kernel for the HTTP benchmarks: a network namespace, a veth pair and a tbf qdisc.

`ShapedLink(rate)` builds namespace `msbench-PID` with a veth pair (HOST 10.77.0.1 in this namespace, PEER
10.77.0.2 inside it) and a token bucket filter of `rate` payload bytes/s on the peer's egress: everything the
server sends to the client crosses it. A server started with `link.exec_argv(argv)` runs inside the namespace and
sends as fast as it can (sendfile, no pacing loop): the kernel holds it to the rate, so the emulated remote host
costs this machine's CPU only what a real server's socket writes would cost the client side. Latency stays the
server's (a sleep before each response's first byte: no CPU). The loopback device is never touched, so tests and
other loopback users on this machine keep their speed.

Needs root, `ip` (iproute2 with netns) and `tc` with the tbf qdisc; `available()` says why not otherwise. The
namespace, its veth pair and its qdisc are removed by `close()` (also from `__exit__`, so on errors and Ctrl-C);
namespaces of earlier runs whose process is gone (a SIGKILL) are removed when the next one starts. Benchmark
facility only: nothing in the package or the tests uses it.
"""
from __future__ import annotations

import os
import shutil
import subprocess

from moestream.weights.diskcache import pid_alive

PREFIX = "msbench-"
HOST_IP, PEER_IP, PREFIX_LEN = "10.77.0.1", "10.77.0.2", 30
MTU = 1500
# tbf counts every byte a packet puts on the wire (Ethernet + IP + TCP headers, timestamps option included);
# the benchmark's bandwidth is payload bytes/s, as the userspace token bucket counted it, so the wire rate is
# scaled by a full segment's overhead: MTU + 14 bytes on the wire carry MTU - 52 bytes of payload
WIRE_PER_PAYLOAD = (MTU + 14) / (MTU - 52)


class ShapingUnavailable(RuntimeError):
    """Kernel shaping cannot be set up here (not root, no `ip`/`tc`, no tbf, namespaces not allowed)."""


def available() -> str | None:
    """None when kernel shaping can be set up here, else why not."""
    if os.geteuid() != 0:
        return "kernel shaping needs root (network namespaces, veth, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"kernel shaping needs `{tool}` (iproute2) on PATH"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True)
    if check and r.returncode:
        raise ShapingUnavailable(f"`{' '.join(argv)}` failed: {r.stderr.strip() or r.stdout.strip()}")
    return r


def namespaces() -> list[str]:
    """Names of this facility's namespaces that exist now."""
    r = _run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.startswith(PREFIX)]


def remove(ns: str) -> None:
    """Kill what runs in namespace `ns` and delete it (its veth pair and qdisc go with it)."""
    pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
    for p in pids:
        try:
            os.kill(int(p), 9)
        except (ProcessLookupError, ValueError):
            pass
    _run("ip", "netns", "del", ns, check=False)
    _run("ip", "link", "del", _host_dev(ns), check=False)  # normally gone with its peer


def remove_stale() -> list[str]:
    """Delete namespaces left by runs whose process is gone; returns their names."""
    gone = []
    for ns in namespaces():
        pid = ns[len(PREFIX):]
        if pid.isdigit() and not pid_alive(int(pid)):
            remove(ns)
            gone.append(ns)
    return gone


def _host_dev(ns: str) -> str:
    return f"msb{ns[len(PREFIX):]}h"[:15]


class ShapedLink:
    """A namespace whose traffic to this one goes through a tbf of `rate` payload bytes/s."""

    def __init__(self, rate: float, burst: int = 1 << 20):
        self.rate, self.burst = rate, burst
        self.ns = f"{PREFIX}{os.getpid()}"
        self.host_dev, self.peer_dev = _host_dev(self.ns), f"msb{os.getpid()}n"[:15]
        self.host_ip, self.peer_ip = HOST_IP, PEER_IP
        self._up = False

    def open(self) -> "ShapedLink":
        why = available()
        if why:
            raise ShapingUnavailable(why)
        remove_stale()
        if _run("ip", "-o", "addr", "show", "to", f"{HOST_IP}/{PREFIX_LEN}", check=False).stdout.strip():
            raise ShapingUnavailable(f"{HOST_IP}/{PREFIX_LEN} is in use on this machine (another shaped link "
                                     f"running? `ip netns list`)")
        self._up = True  # from here on close() cleans up whatever got made
        try:
            ns, h, p = self.ns, self.host_dev, self.peer_dev
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", h, "mtu", str(MTU), "type", "veth", "peer", "name", p, "mtu", str(MTU),
                 "netns", ns)
            _run("ip", "addr", "add", f"{HOST_IP}/{PREFIX_LEN}", "dev", h)
            _run("ip", "link", "set", h, "up")
            _run("ip", "-n", ns, "addr", "add", f"{PEER_IP}/{PREFIX_LEN}", "dev", p)
            _run("ip", "-n", ns, "link", "set", p, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            wire_bits = int(self.rate * 8 * WIRE_PER_PAYLOAD)
            _run("tc", "-n", ns, "qdisc", "add", "dev", p, "root", "tbf", "rate", f"{wire_bits}bit",
                 "burst", str(self.burst), "latency", "200ms")
        except BaseException:
            self.close()
            raise
        return self

    def qdisc(self) -> str:
        """`tc qdisc show` of the shaped device (what the kernel was told)."""
        return _run("tc", "-n", self.ns, "qdisc", "show", "dev", self.peer_dev, check=False).stdout.strip()

    def exec_argv(self, argv: list[str]) -> list[str]:
        """`argv` run inside the namespace (same process: `ip netns exec` execs it)."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def close(self) -> None:
        if self._up:
            self._up = False
            remove(self.ns)

    def __enter__(self) -> "ShapedLink":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


def leftovers() -> dict[str, str]:
    """What of this facility is still on the machine (empty when clean): namespaces, veth devices, tbf qdiscs."""
    out = {}
    if ns := namespaces():
        out["namespaces"] = " ".join(ns)
    links = [ln for ln in _run("ip", "-o", "link", check=False).stdout.splitlines() if ": msb" in ln]
    if links:
        out["links"] = "\n".join(links)
    tbf = [ln for ln in _run("tc", "qdisc", "show", check=False).stdout.splitlines() if "tbf" in ln]
    if tbf:
        out["qdiscs"] = "\n".join(tbf)
    return out
