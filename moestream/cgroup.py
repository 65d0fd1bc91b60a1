"""The RAM budget enforced by the kernel: run a command inside a memory cgroup and report what the kernel saw.

Owns finding a writable memory controller (cgroup v1's memory hierarchy, or v2 with the memory controller
enabled; otherwise a clear reason to skip), the group's life (limit, entry through a tiny shell that writes its own
pid before exec'ing the command, removal), the figures read back (peak charge, times the limit was hit, OOM kills)
and where the memory was at the peak (the parent samples the group's anonymous vs page-cache split; a child that
calls `watch_peak` records its Python stack at each new RSS high-water mark, so an OOM kill still leaves one).
The cap is `budget + interpreter RSS + allowance`, page cache included (v1 charges it to the group). Also the
process's own memory figures from /proc (`rss_now`, `proc_kib`) and the memory it can still take
(`memory_available`).
"""
from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from moestream.config import format_bytes
from moestream.errors import MoestreamError

DEFAULT_ALLOWANCE = 512 << 20  # library code paged in later, glibc arenas, the tokenizer's and headers' page cache
V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
SAMPLE_S = 0.05
PEAK_TRACE_ENV = "MOESTREAM_PEAK_TRACE"  # a child that sees this writes its high-water stacks to that file
PEAK_STEP = 32 << 20  # a new high-water record only when RSS grew by this much since the last one


class CgroupError(MoestreamError):
    """No writable memory cgroup here (the message says why), or a capped run failed."""


@dataclass(frozen=True)
class Controller:
    version: str  # "v1" or "v2"
    root: Path

    def create(self, name: str, limit: int | None) -> Path:
        """A fresh group under the hierarchy's root, limited to `limit` bytes (None: no limit, it only measures)."""
        group = self.root / f"moestream-{name}-{os.getpid()}-{time.monotonic_ns() % 10**9}"
        group.mkdir()
        try:
            if limit is None:
                pass
            elif self.version == "v1":
                _write(group / "memory.limit_in_bytes", limit)
                _write(group / "memory.swappiness", 0, optional=True)
            else:
                _write(group / "memory.max", limit)
                _write(group / "memory.swap.max", 0, optional=True)
        except OSError:
            remove_group(group)
            raise
        return group

    def usage(self, group: Path) -> int:
        return _read_int(group / ("memory.usage_in_bytes" if self.version == "v1" else "memory.current"))

    def split(self, group: Path) -> dict[str, int]:
        """Anonymous memory and page cache now (v1 memory.stat rss/cache, v2 anon/file)."""
        stat = _keyed(group / "memory.stat")
        if self.version == "v1":
            return {"anon": stat.get("rss", 0), "page_cache": stat.get("cache", 0)}
        return {"anon": stat.get("anon", 0), "page_cache": stat.get("file", 0)}

    def figures(self, group: Path) -> tuple[int | None, int, int]:
        """(peak charge or None when the kernel keeps none, times the limit was hit, OOM kills)."""
        if self.version == "v1":
            oom = _keyed(group / "memory.oom_control")
            return (_read_int(group / "memory.max_usage_in_bytes"), _read_int(group / "memory.failcnt"),
                    oom.get("oom_kill", 0))
        events = _keyed(group / "memory.events")
        peak = _read_int(group / "memory.peak") if (group / "memory.peak").exists() else None
        return peak, events.get("max", 0), events.get("oom_kill", 0)


def find_controller() -> tuple[Controller | None, str]:
    """The memory controller this process may create groups in, or (None, why not)."""
    reasons = []
    if (V1_ROOT / "memory.limit_in_bytes").exists():
        if os.access(V1_ROOT, os.W_OK):
            return Controller("v1", V1_ROOT), ""
        reasons.append(f"cgroup v1 memory hierarchy {V1_ROOT} is not writable (run as root)")
    for root in V2_ROOTS:
        controllers = root / "cgroup.controllers"
        if not controllers.exists():
            continue
        if "memory" not in controllers.read_text().split():
            reasons.append(f"cgroup v2 at {root} has no memory controller")
        elif not os.access(root, os.W_OK):
            reasons.append(f"cgroup v2 at {root} is not writable (run as root or with a delegated subtree)")
        elif _enable_v2_memory(root):
            return Controller("v2", root), ""
        else:
            reasons.append(f"cgroup v2 at {root}: cannot enable the memory controller for child groups")
    return None, "; ".join(reasons) or "no cgroup filesystem under /sys/fs/cgroup"


def _enable_v2_memory(root: Path) -> bool:
    control = root / "cgroup.subtree_control"
    if "memory" in control.read_text().split():
        return True
    try:
        control.write_text("+memory")
    except OSError:
        return False
    return "memory" in control.read_text().split()


def cap_for(budget: int, baseline_rss: int, allowance: int = DEFAULT_ALLOWANCE) -> int:
    """The kernel limit for a run under `budget`: the budget, the interpreter's own RSS, a stated allowance."""
    return budget + baseline_rss + allowance


def proc_kib(field: str, path: str | Path = "/proc/self/status") -> int | None:
    """A `Field:   N kB` line of a /proc file (status, meminfo) as N KiB; None when the file or field is missing."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def memory_available(meminfo: str | Path = "/proc/meminfo", cgroups: str | Path = "/proc/self/cgroup",
                     v2_root: Path = Path("/sys/fs/cgroup"), v1_root: Path = V1_ROOT) -> int | None:
    """Bytes this process can still take: the machine's MemAvailable, or less where the process's memory cgroup,
    or a group above it, is nearer its limit (v2 memory.max - memory.current, v1 memory.limit_in_bytes -
    memory.usage_in_bytes; a container's or a systemd slice's limit is one of these). None where /proc/meminfo has
    no MemAvailable."""
    kib = proc_kib("MemAvailable", meminfo)
    if kib is None:
        return None
    room = kib * 1024
    try:
        lines = Path(cgroups).read_text().splitlines()
    except OSError:
        return room
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # v2's unified hierarchy
            root, files = v2_root, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            root, files = v1_root, ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        group = root / rel.strip("/")
        while True:  # the group, then each one above it up to the hierarchy's root
            room = min(room, _group_room(group, *files))
            if group == root or root not in group.parents:
                break
            group = group.parent
    return room


def _group_room(group: Path, limit: str, usage: str) -> int:
    """A memory cgroup's limit less its usage; a very large number where it has no limit or cannot be read."""
    try:
        cap, used = (group / limit).read_text().strip(), int((group / usage).read_text())
    except (OSError, ValueError):
        return 1 << 62
    # v2 says "max" for no limit (v1 a number near 2**63, which the caller's min leaves out)
    return max(0, int(cap) - used) if cap.isdigit() else 1 << 62


def rss_now() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * mmap.PAGESIZE
    except OSError:
        return 0


# ---- one capped run ---------------------------------------------------------------------------------------------
@dataclass
class CappedRun:
    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str
    version: str
    cap_bytes: int | None  # None: the group measured without a limit
    peak_bytes: int  # the kernel's peak charge (v2 without memory.peak: the sampled maximum)
    failcnt: int  # times the charge hit the limit (v2: memory.events max)
    oom_kills: int
    at_peak: dict[str, int] = field(default_factory=dict)  # sampled anon / page cache at the largest charge
    peak_stack: dict | None = None  # the child's Python stack at its last RSS high-water mark, if it recorded one

    @property
    def oom_killed(self) -> bool:
        return self.oom_kills > 0 or self.returncode == -signal.SIGKILL

    def summary(self) -> dict:
        return {"cgroup": self.version, "cap_bytes": self.cap_bytes, "peak_bytes": self.peak_bytes,
                "failcnt": self.failcnt, "oom_killed": self.oom_killed, "returncode": self.returncode,
                "at_peak": self.at_peak, "peak_stack": self.peak_stack}

    def describe(self) -> str:
        """A few lines for a person: the figures, and where the memory was when it peaked."""
        cap = "no cap" if self.cap_bytes is None else f"cap {format_bytes(self.cap_bytes)}"
        lines = [f"cgroup {self.version} {cap}: peak {format_bytes(self.peak_bytes)}, "
                 f"limit hit {self.failcnt} times, " + ("OOM-KILLED" if self.oom_killed else "no OOM kill")]
        if self.at_peak:
            lines.append("at the peak: " + ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}"
                                                     for k, v in self.at_peak.items()))
        if self.peak_stack:
            lines.append(f"child RSS high-water {format_bytes(self.peak_stack['rss_bytes'])} reached in:")
            lines += [f"  {frame}" for frame in self.peak_stack["stack"]]
        return "\n".join(lines)


def run_capped(cmd: list[str], cap: int | None, name: str = "run", env: dict | None = None,
               timeout: float | None = None, trace_peak: bool = True) -> CappedRun:
    """Run `cmd` to completion inside a fresh memory group limited to `cap` bytes (None: unlimited, measured the
    same way), output captured.
    Raises CgroupError when no writable memory controller exists."""
    ctl, why = find_controller()
    if ctl is None:
        raise CgroupError(f"cannot enforce a memory cap here: {why}")
    group = ctl.create(name, cap)
    trace = Path(tempfile.mkstemp(prefix="moestream-peak-", suffix=".json")[1]) if trace_peak else None
    env = dict(os.environ if env is None else env)
    if trace is not None:
        env[PEAK_TRACE_ENV] = str(trace)
    # the shell joins the group before exec: every byte the command ever touches is charged to it
    wrapper = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group / "cgroup.procs"), *cmd]
    sampler = _Sampler(ctl, group)
    try:
        sampler.start()
        try:
            proc = subprocess.run(wrapper, capture_output=True, text=True, env=env, timeout=timeout)
            rc, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, out, err = -signal.SIGKILL, _text(e.stdout), _text(e.stderr) + f"\ntimed out after {timeout} s"
        sampler.stop()
        peak, failcnt, kills = ctl.figures(group)
        return CappedRun(cmd, rc, out, err, ctl.version, cap, peak if peak is not None else sampler.peak,
                         failcnt, kills, sampler.at_peak, _read_trace(trace))
    finally:
        sampler.stop()
        remove_group(group)
        if trace is not None:
            trace.unlink(missing_ok=True)


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


class _Sampler(threading.Thread):
    """Polls the group's charge; keeps the anon / page-cache split at the largest one."""

    def __init__(self, ctl: Controller, group: Path):
        super().__init__(daemon=True)
        self.ctl, self.group = ctl, group
        self.halt = threading.Event()
        self.peak, self.at_peak = 0, {}

    def run(self) -> None:
        while not self.halt.wait(SAMPLE_S):
            try:
                usage = self.ctl.usage(self.group)
                if usage > self.peak:
                    self.peak, self.at_peak = usage, self.ctl.split(self.group)
            except OSError:
                return

    def stop(self) -> None:
        self.halt.set()
        if self.is_alive():
            self.join()


def remove_group(group: Path) -> None:
    """rmdir once the last task has gone (the kernel may need a moment after the exit)."""
    for _ in range(50):
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)


# ---- the child's side: where RSS peaked -------------------------------------------------------------------------
def watch_peak(path: str | Path | None = None, interval: float = 0.02) -> threading.Thread | None:
    """In the capped process: record the main thread's Python stack at each RSS high-water mark into `path`
    (default: the file named by MOESTREAM_PEAK_TRACE; nothing when neither is set). Written atomically each time,
    so what an OOM kill leaves behind is the last record before it."""
    path = path or os.environ.get(PEAK_TRACE_ENV)
    if not path:
        return None
    main = threading.main_thread().ident

    def loop() -> None:
        best = 0
        while True:
            rss = rss_now()
            if rss > best + PEAK_STEP:
                best = rss
                frame = sys._current_frames().get(main)
                frames = traceback.extract_stack(frame) if frame is not None else []
                stack = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames
                         if not f.filename.startswith("<frozen")][-14:]  # imports are noise here
                _write_json(Path(path), {"rss_bytes": rss, "stack": stack[::-1]})
            time.sleep(interval)

    thread = threading.Thread(target=loop, name="moestream-peak-watch", daemon=True)
    thread.start()
    return thread


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _read_trace(path: Path | None) -> dict | None:
    if path is None:
        return None
    path.with_suffix(".tmp").unlink(missing_ok=True)
    try:
        return json.loads(path.read_text()) or None
    except (OSError, ValueError):
        return None


# ---- small file helpers -------------------------------------------------------------------------------------------
def _write(path: Path, value: int, optional: bool = False) -> None:
    try:
        path.write_text(str(value))
    except OSError:
        if not optional:
            raise


def _read_int(path: Path) -> int:
    return int(path.read_text().split()[0])


def _keyed(path: Path) -> dict[str, int]:
    out = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out
