"""The batch input file (OpenAI Batch API request format, one JSON object a line): index, fingerprint, requests.

Owns the one pass over the file that fingerprints it (sha256), finds each request's line and `custom_id`, marks
duplicates, and refuses a file that is not JSONL at all before any work starts; then the lazy second pass that
yields `BatchRequest`s for the lines still to do. Validating a request's body is prepare.py's job.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from moestream.errors import MoestreamError

SNIFF_BYTES = 64 * 1024  # the head that must be text (UTF-8, no NUL bytes)
SNIFF_LINES = 8  # if none of the first this-many requests is a JSON object, the file is not JSONL


class InputError(MoestreamError):
    """The batch input file cannot be used at all (missing, empty, binary, not JSONL)."""


@dataclass
class BatchRequest:
    """One request of a batch: the output line's `id`, and either the decoded line or why it cannot run."""

    id: str
    line: Any  # the decoded JSON line (a dict for a usable request)
    problem: tuple[str, str] | None = None  # (error code, message), decided before the body is looked at
    lineno: int = 0


@dataclass
class _Ref:
    lineno: int
    offset: int
    custom_id: str | None
    is_object: bool
    error: str | None  # why the line is not JSON


@dataclass
class InputIndex:
    """Where each request of an input file is; `fingerprint` changes whenever any byte of the file does."""

    path: Path
    fingerprint: str
    size: int
    refs: list[_Ref]
    duplicates: dict[str, list[int]]  # custom_id -> line numbers, for ids used more than once

    def __len__(self) -> int:
        return len(self.refs)

    def request_id(self, ref: _Ref) -> str:
        """Deterministic, so a resumed job recognises lines it already wrote (even those without a custom_id)."""
        return f"batch_req_{self.fingerprint[:12]}_{ref.lineno}"

    def ids(self) -> list[str]:
        """The output ids of every request, duplicates of a custom_id folded into the first line's."""
        return [self.request_id(r) for r in self._unique()]

    def _unique(self) -> Iterator[_Ref]:
        for ref in self.refs:
            lines = self.duplicates.get(ref.custom_id) if ref.custom_id is not None else None
            if lines is None or lines[0] == ref.lineno:
                yield ref

    def requests(self, skip: set[str] = frozenset()) -> Iterator[BatchRequest]:
        """Reads the file again, lazily, yielding every request whose id is not in `skip`."""
        todo = [r for r in self._unique() if self.request_id(r) not in skip]
        with open(self.path, "rb") as f:
            for ref in todo:
                f.seek(ref.offset)
                yield self._request(ref, f.readline())

    def _request(self, ref: _Ref, raw: bytes) -> BatchRequest:
        rid = self.request_id(ref)
        if ref.error is not None:
            return BatchRequest(rid, None, ("invalid_json", f"line {ref.lineno} is not valid JSON: {ref.error}"),
                                ref.lineno)
        line = json.loads(raw)
        if ref.custom_id in self.duplicates:
            where = ", ".join(map(str, self.duplicates[ref.custom_id]))
            return BatchRequest(rid, line, ("duplicate_custom_id", f"custom_id {ref.custom_id!r} is used on lines "
                                            f"{where}; custom_ids must be unique, so none of them ran"), ref.lineno)
        return BatchRequest(rid, line, None, ref.lineno)


def index_input(path: str | Path) -> InputIndex:
    """One pass over the file: fingerprint, request lines, custom_ids; an InputError if it is not JSONL at all."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such input file")
    digest, refs, offset = hashlib.sha256(), [], 0
    with open(path, "rb") as f:
        _sniff(path, f.read(SNIFF_BYTES))
        f.seek(0)
        for lineno, raw in enumerate(f, 1):
            digest.update(raw)
            if raw.strip():
                refs.append(_ref(lineno, offset, raw))
            offset += len(raw)
    if not refs:
        raise InputError(f"{path}: the file is empty (no requests)")
    head = refs[:SNIFF_LINES]
    if not any(r.is_object for r in head):
        why = head[0].error or "not a JSON object"
        raise InputError(f"{path}: this is not a JSONL batch file: none of its first {len(head)} lines is a JSON "
                         f"object (line {head[0].lineno}: {why})")
    counts = Counter(r.custom_id for r in refs if r.custom_id is not None)
    dups = {cid: [r.lineno for r in refs if r.custom_id == cid] for cid, n in counts.items() if n > 1}
    return InputIndex(path, digest.hexdigest(), offset, refs, dups)


def _sniff(path: Path, head: bytes) -> None:
    if b"\0" in head:
        raise InputError(f"{path}: this is a binary file, not a JSONL batch file")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 3:  # not just a character cut at the end of the sniffed head
            raise InputError(f"{path}: this is not UTF-8 text (byte {e.start}), not a JSONL batch file") from None


def _ref(lineno: int, offset: int, raw: bytes) -> _Ref:
    try:
        line = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return _Ref(lineno, offset, None, False, str(e))
    cid = line.get("custom_id") if isinstance(line, dict) else None
    return _Ref(lineno, offset, cid if isinstance(cid, str) and cid else None, isinstance(line, dict), None)


def requests_from(lines: Iterable[dict]) -> list[BatchRequest]:
    """Batch requests from in-memory request dicts (what a file holds, one per line), for programmatic callers."""
    return [BatchRequest(f"batch_req_{i}", line, None, i) for i, line in enumerate(lines, 1)]
