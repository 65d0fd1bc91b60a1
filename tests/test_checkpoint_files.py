"""Hostile or damaged checkpoint files: safetensors headers, index weight_maps and pack manifests that lie about
shapes, offsets or paths are refused at open with a CheckpointError naming the file and tensor, never read."""
from __future__ import annotations

import json
import os
import shutil
import struct
import threading
from pathlib import Path

import pytest

from conftest import synth_tiny
from moestream import Engine
from moestream.errors import CheckpointError
from moestream.weights.index import PACK_MANIFEST, CheckpointIndex
from moestream.pack import pack


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return synth_tiny(tmp_path_factory, "qwen3_moe")


@pytest.fixture(scope="module")
def packed(tiny, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("files_packed") / "packed"
    pack(tiny, dst)
    return dst


def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "ckpt"))


def _shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def _rewrite_header(shard: Path, change) -> str:
    """Parse the shard's header, let `change(header)` edit it (returns the tensor it damaged), write it back."""
    data = shard.read_bytes()
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + hlen])
    name = change(header)
    body = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(body)) + body + data[8 + hlen:])
    return name


def _first(header: dict) -> str:
    return next(k for k in header if k != "__metadata__" and len(header[k]["shape"]) == 2)


def _negate_shape(h):  # same element count, so the byte range still "matches"
    n = _first(h)
    h[n]["shape"] = [-s for s in h[n]["shape"]]
    return n


def _float_offsets(h):
    n = _first(h)
    h[n]["data_offsets"] = [float(o) for o in h[n]["data_offsets"]]
    return n


def _string_shape(h):
    n = _first(h)
    h[n]["shape"] = [str(s) for s in h[n]["shape"]]
    return n


def _bool_shape(h):  # true == 1 in Python, but a JSON boolean is not a dimension
    n = _first(h)
    h[n]["shape"] = [*h[n]["shape"], True]
    return n


def _overlap(h):
    names = [k for k in h if k != "__metadata__"]
    a, b = names[0], names[1]
    h[b]["dtype"], h[b]["shape"], h[b]["data_offsets"] = h[a]["dtype"], h[a]["shape"], h[a]["data_offsets"]
    return b


def _list_dtype(h):
    n = _first(h)
    h[n]["dtype"] = ["BF16"]
    return n


def _reversed_offsets(h):
    n = _first(h)
    begin, end = h[n]["data_offsets"]
    h[n]["shape"], h[n]["data_offsets"] = [0], [end, begin]
    return n


@pytest.mark.parametrize("change", [_negate_shape, _float_offsets, _string_shape, _bool_shape, _overlap, _list_dtype,
                                    _reversed_offsets])
def test_lying_header_entry_is_refused_naming_file_and_tensor(tiny, tmp_path, change):
    path = _copy(tiny, tmp_path)
    shard = _shards(path)[0]
    name = _rewrite_header(shard, change)
    with pytest.raises(CheckpointError) as e:
        CheckpointIndex.open(path)
    assert shard.name in str(e.value) and name in str(e.value)


def test_header_that_is_not_an_object_or_too_deep(tiny, tmp_path):
    path = _copy(tiny, tmp_path)
    shard = _shards(path)[0]
    for body in (b"[1, 2, 3]", b"[" * 100_000 + b"]" * 100_000):
        shard.write_bytes(struct.pack("<Q", len(body)) + body)
        with pytest.raises(CheckpointError, match=shard.name):
            CheckpointIndex.open(path)


# ---- file names from the checkpoint's own JSON ------------------------------------------------------------------
def _point_weight_map(path: Path, shard: Path, target: str) -> None:
    idx = path / "model.safetensors.index.json"
    data = json.loads(idx.read_text())
    data["weight_map"] = {k: (target if v == shard.name else v) for k, v in data["weight_map"].items()}
    idx.write_text(json.dumps(data))


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_shard_outside_the_directory_is_refused(tiny, tmp_path, how):
    path = _copy(tiny, tmp_path)
    shard = _shards(path)[0]
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(shard, outside)
    if how == "dotdot":
        _point_weight_map(path, shard, "../elsewhere.safetensors")
    elif how == "absolute":
        _point_weight_map(path, shard, str(outside))
    else:
        shard.symlink_to(outside)
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        CheckpointIndex.open(path)


def test_weight_map_value_not_a_string(tiny, tmp_path):
    path = _copy(tiny, tmp_path)
    _point_weight_map(path, _shards(path)[0], 7)
    with pytest.raises(CheckpointError, match="weight_map"):
        CheckpointIndex.open(path)


def _opens_within(path: Path, seconds: float) -> BaseException | None:
    """Open `path` on a daemon thread; the exception it raised, or AssertionError if it did not finish in time."""
    got: list[BaseException | None] = []

    def run() -> None:
        try:
            CheckpointIndex.open(path)
            got.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            got.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert got, "opening the checkpoint blocked (it opened a FIFO)"
    return got[0]


def test_fifo_shard_is_refused_not_waited_on(tiny, tmp_path):
    path = _copy(tiny, tmp_path)
    shard = _shards(path)[0]
    shard.unlink()
    os.mkfifo(shard)
    err = _opens_within(path, 20)
    assert isinstance(err, CheckpointError) and "regular file" in str(err)


def test_hub_cache_snapshot_links_into_blobs_are_accepted(tiny, tmp_path):
    """huggingface_hub's cache: snapshots/<rev>/<file> are links to ../../blobs/<hash>; that layout is normal."""
    repo = tmp_path / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "rev1", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in tiny.iterdir():
        if f.is_file():
            shutil.copyfile(f, blobs / f"hash-{f.name}")
            (snap / f.name).symlink_to(Path("../../blobs") / f"hash-{f.name}")
    assert len(CheckpointIndex.open(snap).tensors) == len(CheckpointIndex.open(tiny).tensors)


# ---- pack manifests ---------------------------------------------------------------------------------------------
def _edit_manifest(path: Path, change) -> None:
    m = json.loads((path / PACK_MANIFEST).read_text())
    change(m)
    (path / PACK_MANIFEST).write_text(json.dumps(m))


@pytest.mark.parametrize("align", [0, -4096, 3000, "4096", 1.5])
def test_bad_pack_alignment_is_a_clear_error(packed, tmp_path, align):
    path = Path(shutil.copytree(packed, tmp_path / "p"))
    _edit_manifest(path, lambda m: m.update(align=align))
    with pytest.raises(CheckpointError, match="align"):
        CheckpointIndex.open(path)


@pytest.mark.parametrize("key", ["dense_files", "expert_files"])
@pytest.mark.parametrize("escape", ["../outside.bin", "/etc/hostname"])
def test_pack_manifest_paths_stay_inside(packed, tmp_path, key, escape):
    path = Path(shutil.copytree(packed, tmp_path / "p"))
    (tmp_path / "outside.bin").write_bytes(b"\0" * 64)
    _edit_manifest(path, lambda m: m.update({key: [escape, *m[key][1:]]}))
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        CheckpointIndex.open(path)


def test_negative_manifest_numbers_are_refused(packed, tmp_path):
    path = Path(shutil.copytree(packed, tmp_path / "p"))

    def change(m):
        m["experts"][0]["length"] = -m["experts"][0]["length"]

    _edit_manifest(path, change)
    with pytest.raises(CheckpointError, match="length"):
        Engine.open(path)
