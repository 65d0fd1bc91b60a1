"""The batch output file: crash-safe appends, resume, and the input fingerprint kept beside it.

Owns OUTPUT.jsonl and its sidecar OUTPUT.jsonl.state (the input's sha256). Results are appended in groups, each
written whole and fsynced, so a kill at any moment loses at most the group not yet synced; on resume a torn or
unreadable tail is cut and the ids already written are skipped. A write that fails (disk full, read-only) is
rolled back to the last whole group and reported as an OutputError; nothing written before is touched. A job
holds an exclusive lock on OUTPUT while it runs (`lock_output`), so a second job on the same output stops with a
clear error instead of writing every result again beside the first (the kernel drops the lock when the holder
dies, SIGKILL included, so a killed job never leaves a stale one).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from moestream.batch.inputs import InputIndex
from moestream.errors import MoestreamError

STATE_VERSION = 1


class OutputError(MoestreamError):
    """The output file cannot be written, or belongs to another input."""


@dataclass
class Resume:
    done: set[str]  # ids of the requests already in the output
    cut_bytes: int  # bytes of a torn or unreadable tail removed


def state_path(output: Path) -> Path:
    return output.with_name(output.name + ".state")


def _why(e: OSError, path: Path) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk holding {path} is full"
    if e.errno == errno.EROFS:
        return f"{path} is on a read-only file system"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"no permission to write {path}"
    return f"cannot write {path}: {e.strerror or e}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_state(path: Path, index: InputIndex) -> None:
    """Atomically: a temp file, fsync, rename, fsync of the directory."""
    tmp = path.with_name(path.name + ".tmp")
    body = json.dumps({"version": STATE_VERSION, "input": str(index.path.resolve()), "sha256": index.fingerprint,
                       "size": index.size, "requests": len(index.ids())}) + "\n"
    try:
        with open(tmp, "w") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # a read-only file system: there is no temp file to remove
            pass
        raise OutputError(f"{_why(e, path)}; nothing was run") from None


def lock_output(output: Path) -> int:
    """Open OUTPUT (creating it empty if new) and take an exclusive lock on it for this job; returns the fd to close
    at the end. OutputError if another job holds it."""
    if not output.parent.is_dir():
        raise OutputError(f"{output.parent}: no such directory for the output file")
    try:
        fd = os.open(output, os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError as e:
        raise OutputError(f"{_why(e, output)}; nothing was run") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise OutputError(f"{output} is being written by another moestream batch job (it holds the file's lock): "
                              "wait for that job to end (the same command then continues where it stops), or give "
                              "this one another -o") from None
        raise OutputError(f"cannot lock {output}: {e.strerror or e}; nothing was run") from None
    return fd


def check_owner(output: Path, index: InputIndex) -> None:
    """Refuse an output that belongs to another input file (or to no batch job at all); record ours if new. Runs
    under `lock_output`, which has checked the directory."""
    state = state_path(output)
    if state.exists():
        try:
            recorded = json.loads(state.read_text())["sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            raise OutputError(f"{state} is unreadable: delete {output} and {state} to start over") from None
        if recorded != index.fingerprint:
            raise OutputError(f"{index.path} has changed since this job started (its sha256 differs from the one "
                              f"in {state}): the results in {output} belong to the old file. Restore it, or use "
                              f"another -o (or delete {output} and {state}) to start over")
        return
    if output.exists() and output.stat().st_size > 0:
        raise OutputError(f"{output} already exists and has no {state.name} beside it, so it is not this job's "
                          "output: choose another -o or delete it")
    _write_state(state, index)


def scan(output: Path) -> Resume:
    """Ids already written; cuts a torn last line (or anything after the first unreadable line)."""
    if not output.exists():
        return Resume(set(), 0)
    done, good = set(), 0
    with open(output, "rb") as f:
        for raw in f:
            line = _parse(raw)
            if line is None:
                break
            done.add(line["id"])
            good += len(raw)
    size = output.stat().st_size
    if good < size:
        try:
            with open(output, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        except OSError as e:
            raise OutputError(f"{_why(e, output)}: cannot cut its torn last line") from None
    return Resume(done, size - good)


def _parse(raw: bytes) -> dict | None:
    if not raw.endswith(b"\n"):
        return None
    try:
        line = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return line if isinstance(line, dict) and isinstance(line.get("id"), str) else None


class OutputWriter:
    """Appends result lines in fsynced groups of `group_lines` lines or `group_s` seconds, whichever comes first."""

    def __init__(self, path: Path, group_lines: int = 64, group_s: float = 2.0):
        self.path, self.group_lines, self.group_s = path, max(1, group_lines), group_s
        self.buf: list[str] = []
        self.written = 0
        self.broken: OutputError | None = None  # set by a failed write: nothing more is written
        self._synced_at = time.monotonic()
        existed = path.exists()
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            if not existed:
                _fsync_dir(path.parent)
        except OSError as e:
            raise OutputError(f"{_why(e, path)}; nothing was run") from None

    def add(self, line: dict) -> None:
        if self.broken is not None:
            raise self.broken
        self.buf.append(json.dumps(line, ensure_ascii=False) + "\n")
        if len(self.buf) >= self.group_lines or time.monotonic() - self._synced_at >= self.group_s:
            self.flush()

    def flush(self) -> None:
        self._synced_at = time.monotonic()
        if not self.buf or self.broken is not None:
            return
        data = "".join(self.buf).encode("utf-8")
        start = os.fstat(self.fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
            os.fsync(self.fd)
        except OSError as e:
            self._roll_back(start)
            self.broken = OutputError(
                f"{_why(e, self.path)}: stopped after {self.written} results were written this run ({len(self.buf)} "
                "finished ones are lost and will be redone); what was written is kept: fix that and run the same "
                "command again to continue")
            raise self.broken from None
        self.written += len(self.buf)
        self.buf = []

    def _roll_back(self, size: int) -> None:
        """Cut a partly written group, so the file ends on a whole line (a resume would cut it anyway)."""
        try:
            os.ftruncate(self.fd, size)
            os.fsync(self.fd)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.flush()
        finally:
            os.close(self.fd)
