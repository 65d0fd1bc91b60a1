"""b12 with exceptions ("b12x"): a row whose few values lie 2^15 or more below its largest keeps them beside the
row instead of being stored whole. Exact round trips (Python and native), every native product over such a matrix
bit for bit the bf16 matrix's (one token, the few-token tiles, the decoded many-row path, bf16 compute, the GLU
kernels), the size a wide Gaussian matrix takes, and a damaged table refused before any kernel reads it; packed
experts in the smaller form, their logits the original's, and a damaged coded expert refused when it is read."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from moestream.cli import main
from moestream.errors import CheckpointError
from moestream.kernels import b12, cpu, fused
from moestream.models import blocks
from moestream.weights.index import PACK_MANIFEST, CheckpointIndex
from test_b12 import _bits, _matrix, assert_same_outputs

native = pytest.mark.skipif(not cpu.available(), reason="native kernels not built")


def _with_misfits(n: int, k: int, seed: int) -> torch.Tensor:
    """A matrix whose rows 1, 2 (a pair), 7 and the last hold a few values far below the rest (exceptions), row 4
    a zero in every other column (too many: stored whole), row 5 nothing special."""
    w = _matrix(n, k, seed)
    for r, cols, vals in ((1, [0, 5], [0.0, 1e-12]), (2, [k - 1], [-0.0]), (7, [3, 4, 64], [0.0, -1e-12, 1e-30]),
                          (n - 1, [k // 2], [1e-20])):
        w[r, cols] = torch.tensor(vals).bfloat16()
    w[4, ::2] = 0.0
    return w


def test_round_trip_with_exceptions_and_the_sizes():
    w = _with_misfits(40, 192, 1)
    plain, coded = b12.encode(w), b12.encode(w, exceptions=True)
    raw, exc = b12.scan(w, exceptions=True)
    assert raw == 1 and exc >= 7 and b12.scan(w)[0] >= 5
    assert coded.numel() == b12.coded_nbytes(40, 192, raw, exc) < plain.numel()
    assert torch.equal(_bits(b12.decode(coded, 40, 192)), _bits(w))
    assert torch.equal(_bits(b12.decode_rows(coded, 40, 192, 2, 9)), _bits(w[2:9]))
    bases = coded[40 * 288:40 * 288 + 40]
    assert [int(b) & b12.XFLAG for b in bases[[1, 2, 7, 39]]] == [b12.XFLAG] * 4 and int(bases[4]) == b12.RAW
    # a wide Gaussian matrix (K3's lm_head rows: 7,168 values): without exceptions about half its rows are stored
    # whole, with them it takes about three quarters of its bf16 bytes
    wide = _matrix(256, 7168, 2, std=0.02)
    assert b12.scan(wide)[0] > 64
    assert b12.encode(wide, exceptions=True).numel() < 0.76 * wide.numel() * 2


def test_rows_too_wide_or_too_many_misfits_are_stored_whole():
    w = _matrix(3, 64, 3)
    w[0, :17] = 0.0  # 17 exceptions take 68 bytes, more than the row's 64 values: stored whole
    w[1, :16] = 0.0  # 16 take 64: kept as exceptions
    assert b12.scan(w, exceptions=True) == (1, 16)
    assert b12.scan(torch.zeros(2, b12.MAX_XK + 64).bfloat16().index_fill_(1, torch.tensor([0]), 1.0),
                    exceptions=True) == (2, 0)


def test_a_damaged_exception_table_is_refused():
    w = _with_misfits(16, 128, 4)
    coded = b12.encode(w, exceptions=True)
    at = 16 * 192 + 64  # the offsets, after the slots and the padded base bytes
    entries = at + 128  # 17 offsets padded to 128 bytes
    for where, value in ((at + 4 * 2, 99), (at, 1)):  # offsets out of order / not from 0
        bad = coded.clone()
        bad[where] = value
        with pytest.raises(ValueError, match="offsets"):
            b12.exception_table(bad, 16, 128)
    bad = coded.clone()
    bad[entries + 3] = 0x7F  # the first exception's position far past its row
    with pytest.raises(ValueError, match="position"):
        b12.exception_table(bad, 16, 128)
    bad = coded.clone()
    bad[16 * 192 + 5] |= b12.XFLAG  # a flagged row without exceptions
    with pytest.raises(ValueError, match="offsets"):
        b12.exception_table(bad, 16, 128)


@native
def test_native_decode_of_rows_with_exceptions():
    w = _with_misfits(33, 256, 5)
    coded = b12.encode(w, exceptions=True)
    out = torch.empty(33, 256, dtype=torch.bfloat16)
    cpu.required().ms_b12_decode(coded.data_ptr(), 33, 256, out.data_ptr())
    assert torch.equal(_bits(out), _bits(w))
    assert torch.equal(_bits(cpu.b12_decode_rows(coded, 33, 256, 6, 9, torch.empty(3, 256, dtype=torch.bfloat16))),
                       _bits(w[6:9]))


@native
@pytest.mark.parametrize("compute", ["fp32", "bf16"])
def test_dense_products_over_exceptions_equal_the_bf16_matrix(compute):
    """blocks.linear over the coded matrix: 1 token (b12_gemv), 2-15 (the tiles), 16+ (decoded rows) and, in bf16
    compute, its kernels: the bf16 matrix's bits at every row count."""
    w = _with_misfits(72, 320, 6)
    bw = b12.B12Weight.wrap(b12.encode(w, exceptions=True), (72, 320))
    g = torch.Generator().manual_seed(7)
    with blocks.compute_dtype(compute):
        for tokens in (1, 2, 3, 8, 9, 15, 16, 17, 40):
            x = torch.randn(tokens, 320, generator=g)
            assert torch.equal(blocks.linear(x, bw), blocks.linear(x, w)), tokens


@native
@pytest.mark.parametrize("compute", ["fp32", "bf16"])
def test_glu_over_experts_with_exceptions_sums_as_on_bf16(compute):
    inter, k, d = 128, 128, 64
    ws = [_with_misfits(inter, k, 8), _with_misfits(inter, k, 9), _with_misfits(d, inter, 10)]
    codes = [b12.encode(m, exceptions=True) for m in ws]
    g = torch.Generator().manual_seed(11)
    for tokens in (1, 2, 5, 15, 16, 40):
        x = torch.randn(tokens, k, generator=g)
        ref, got = torch.zeros(tokens, d), torch.zeros(tokens, d)
        fused.moe_glu_bf16(x, [0], [tuple(m.data_ptr() for m in ws)], inter, ref, compute=compute)
        fused.moe_glu_bf16(x, [0], [tuple(c.data_ptr() | 1 for c in codes)], inter, got, compute=compute)
        assert torch.equal(ref, got), tokens


def test_streamed_slabs_carry_their_rows_exceptions(tmp_path):
    """A coded matrix read a slab of rows at a time (engine/residency.py _CodedRows, a streamed coded lm_head):
    each slab is a coded matrix of its own whose exceptions and rows stored whole are its rows', bit for bit."""
    from moestream.engine.residency import _CodedRows
    from moestream.weights.index import TensorInfo

    w = _with_misfits(200, 128, 12)
    w[10:36, 3] = 0.0
    coded = b12.encode(w, exceptions=True)
    path = tmp_path / "m.bin"
    path.write_bytes(bytes(128) + coded.numpy().tobytes())
    rows = _CodedRows(TensorInfo("m", path, 128, coded.numel(), "BF16", (200, 128), "b12"))
    for start, n in ((0, 20), (3, 5), (30, 17), (0, 200), (190, 10)):
        for direct in (False, True):  # its slots by a buffered read, or by one O_DIRECT read where it is allowed
            slab = rows.read(start, n, direct=direct)
            assert slab.numel() == rows.nbytes(start, n)
            assert torch.equal(_bits(b12.decode(slab, n, 128)), _bits(w[start:start + n])), (start, n, direct)
    bad = bytearray(path.read_bytes())
    bad[128 + 200 * 192 + 256 + 4 * 20 + 3] = 0x7F  # an offset of the table out of order
    path.write_bytes(bytes(bad))
    with pytest.raises(CheckpointError, match="offsets"):
        _CodedRows(TensorInfo("m", path, 128, coded.numel(), "BF16", (200, 128), "b12"))


@native
def test_a_coded_heads_leading_rows_stay_resident(tmp_path, monkeypatch):
    """A packed b12x lm_head streamed with its leading rows resident (a coded matrix of their own, sized from the
    head's base bytes and exception table): at budgets between the floor and all-resident, logits and tokens equal
    the all-resident run's, the dense bytes are the plan's, and a step reads the plan's bytes."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from conftest import prompt_ids, save_reference
    from moestream import Engine
    from moestream.engine import residency
    from moestream.engine.engine import plan
    from moestream.engine.residency import plan_residency
    from moestream.pack import pack

    cfg = Qwen3MoeConfig(vocab_size=2048, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                         num_experts=8, num_experts_per_tok=2, mlp_only_layers=[2], norm_topk_prob=True,
                         initializer_range=0.1, tie_word_embeddings=False)
    src, dst = tmp_path / "src", tmp_path / "dst"
    save_reference(Qwen3MoeForCausalLM, cfg, src)
    for f in src.glob("*.safetensors"):
        t = {k: v.bfloat16() for k, v in load_file(f).items()}
        if "lm_head.weight" in t:  # a value far below the rest in most rows (exceptions), a few rows stored whole
            t["lm_head.weight"][::2, 5] = 0.0
            t["lm_head.weight"][[3, 700, 701], :40] = 0.0
        save_file(t, f, metadata={"format": "pt"})
    pack(src, dst, codec="b12")
    assert json.loads((dst / "moestream-pack.json").read_text())["dense_codec"]["lm_head.weight"]["codec"] == "b12x"
    monkeypatch.setattr(residency, "HEAD_SLAB_BYTES", 8192)
    monkeypatch.setattr(residency, "EMBED_ROWS_BYTES", 1024)
    room = 4 * 2 * 256 * 2 * 16 * 4 + 40 * 2048 * 4
    ids = prompt_ids(2048, 40)
    want = Engine.open(dst, state_room=room)
    want_logits, want_tokens = want.logits(ids), want.generate(ids, 6, stop_token_ids=[])
    want.close()
    p = plan(dst)
    full = plan_residency(p, None, room)
    partial = [b for b in range(full.min_ram_budget, full.all_resident_budget, 4096)
               if 0 < plan_residency(p, b, room).head_resident_rows]
    assert partial, "no budget keeps part of the coded head"
    for budget in (partial[0], partial[-1]):
        r = plan_residency(p, budget, room)
        eng = Engine.open(dst, ram_budget=budget, state_room=room)
        assert type(eng.model.residency.head_part) is b12.B12Weight
        assert eng.model.residency.head_part.numel() == r.head_resident_bytes
        assert torch.equal(eng.logits(ids), want_logits) and eng.generate(ids, 6, stop_token_ids=[]) == want_tokens
        assert eng.stats["peak_resident_bytes"] <= budget and eng.stats["dense_bytes"] == r.resident_dense_bytes
        state = eng.new_sequence()
        eng.step([(state, [5, 6, 7])])
        before = eng.stats["dense_stream_bytes_read"]
        eng.step([(state, [9])])
        got = eng.stats["dense_stream_bytes_read"] - before
        assert got == r.streamed_bytes_per_step + (64 * 2 if r.embed_streamed else 0), budget
        eng.close()


def _damaged_forms(coded: torch.Tensor, n: int, k: int) -> dict[str, torch.Tensor]:
    """Copies of a coded matrix (rows 1, 2, 7 and the last with exceptions, row 4 stored whole: _with_misfits)
    each broken in one way the kernels could not survive."""
    slot, head = n * k * 3 // 2, n * k * 3 // 2 + -(-n // 64) * 64
    raw_at = 4 * (k * 3 // 2)  # row 4's slot: its bf16 row's offset
    out = {"too short": coded[:head - 1].clone()}
    for what, value in (("raw offset past the end", coded.numel()), ("raw offset into the slots", 8),
                        ("raw offset odd", int(coded[raw_at:raw_at + 8].view(torch.int64)) + 1)):
        bad = coded.clone()
        bad[raw_at:raw_at + 8] = torch.tensor([value], dtype=torch.int64).view(torch.uint8)
        out[what] = bad
    bad = coded.clone()
    bad[head + 4 * 2] = 0x7F  # the table's offsets out of order
    out["table offsets"] = bad
    bad = coded.clone()
    bad[slot + 5] |= b12.XFLAG  # a flagged row without exceptions
    out["flag without exceptions"] = bad
    return out


@pytest.mark.parametrize("path", ["native", "python"])
def test_a_coded_matrix_the_kernels_could_not_read_is_refused(path, monkeypatch):
    """b12.check_bytes, which the expert store runs on every coded expert it reads: the native check and the
    Python one (no library) pass a sound matrix of either form and refuse each kind of damage."""
    if path == "native" and not cpu.available():
        pytest.skip("native kernels not built")
    if path == "python":
        monkeypatch.setattr(cpu, "available", lambda: False)
    n, k = 40, 192
    w = _with_misfits(n, k, 21)
    for exceptions in (False, True):
        b12.check_bytes(b12.encode(w, exceptions=exceptions), n, k)
    for what, bad in _damaged_forms(b12.encode(w, exceptions=True), n, k).items():
        with pytest.raises(ValueError, match="b12: "):
            b12.check_bytes(bad, n, k)
            pytest.fail(what)


@pytest.fixture(scope="module")
def packed_with_exceptions(tmp_path_factory):
    """A Qwen3-MoE checkpoint whose experts' rows hold a value or two far below the rest (about a row in eight of
    every expert matrix), packed with `--codec b12`."""
    from safetensors.torch import load_file, save_file

    from test_b12 import _to_bf16
    from test_pack import _qwen

    root = tmp_path_factory.mktemp("b12x_experts")
    src, dst = root / "src", root / "dst"
    _qwen(src)
    _to_bf16(src)
    for f in src.glob("*.safetensors"):
        t = load_file(f)
        for name in (n for n in t if ".experts." in n):
            rows = t[name].shape[-2]
            t[name][..., ::8, 5] = 0.0  # exceptions
            t[name][..., 3 % rows, 7] = 1e-30
        save_file(t, f, metadata={"format": "pt"})
    assert main(["pack", str(src), str(dst), "--codec", "b12"]) == 0
    return src, dst


def test_packed_experts_keep_their_misfits_as_exceptions(packed_with_exceptions):
    """pack codes each expert matrix in the smaller of its two forms: here b12x (the manifest says so, tensor and
    part), smaller than plain b12 would be; the expert tensors load as the original's values, and the engine's
    logits and tokens (warm, and under a budget that evicts, every coded expert checked as it is read) are the
    original's bit for bit."""
    src, dst = packed_with_exceptions
    manifest = json.loads((dst / PACK_MANIFEST).read_text())
    parts = [p for e in manifest["experts"] for p in e["parts"]]
    assert parts and all(p["codec"] == "b12x" for p in parts)
    assert all(t["codec"] == "b12x" for n, t in manifest["tensors"].items() if ".experts." in n)
    a, b = CheckpointIndex.open(src), CheckpointIndex.open(dst)
    for p in parts:
        w = a.load(p["tensor"])
        w = w[p["index"]] if p["index"] is not None else w
        raw, exc = b12.scan(w, exceptions=True)
        assert exc > 0
        assert p["nbytes"] == b12.coded_nbytes(*w.shape, raw, exc) < b12.coded_nbytes(*w.shape, b12.raw_rows(w))
    for n in a.names():
        if ".experts." in n:
            assert b[n].codec == "b12" and torch.equal(a.load(n), b.load(n)), n
    assert_same_outputs(src, dst)


def test_an_expert_whose_coding_is_damaged_is_refused_when_read(packed_with_exceptions, tmp_path):
    """An expert whose exception table is broken but whose crc32 was made to match (so the checksum cannot tell):
    reading it raises a CheckpointError naming the layer, the expert and the part, before a kernel touches it."""
    from moestream.weights.crc import crc32

    _, dst = packed_with_exceptions
    bad = tmp_path / "bad"
    shutil.copytree(dst, bad)
    manifest = json.loads((bad / PACK_MANIFEST).read_text())
    rec = manifest["experts"][5]
    part = rec["parts"][0]
    n, k = part["shape"][-2:]
    at = rec["offset"] + part["offset"] + n * k * 3 // 2 + -(-n // 64) * 64 + 4 * 2  # its table's third offset
    path = bad / rec["file"]
    data = bytearray(path.read_bytes())
    data[at] = 0x7F
    path.write_bytes(bytes(data))
    rec["crc32"] = crc32(memoryview(data)[rec["offset"]:rec["offset"] + rec["length"]])
    (bad / PACK_MANIFEST).write_text(json.dumps(manifest))
    from moestream.engine.engine import plan

    store = plan(bad).store
    store.read(rec["layer"], (rec["expert"] + 1) % 12)  # its neighbours read as before
    with pytest.raises(CheckpointError, match=rf"layer {rec['layer']} expert {rec['expert']} part .*exception table"):
        store.read(rec["layer"], rec["expert"])
    store.close()
