"""b12, the lossless 12-bit coding of bf16 expert matrices (`moestream pack --codec b12`): exact round trips, the
native kernels' sums bit for bit those of the bf16 weights, a coded pack's logits and tokens equal to the
original's under evictions, and a damaged manifest refused."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import prompt_ids
from moestream import Engine
from moestream.cli import main
from moestream.errors import CheckpointError, MoestreamError
from moestream.kernels import b12, cpu, fused
from moestream.pack import CODED_K3, CODED_MLP, pack
from moestream.weights.index import PACK_MANIFEST, CheckpointIndex
from test_pack import VOCAB, _budget, _mixtral, _qwen

native = pytest.mark.skipif(not cpu.available(), reason="native kernels not built")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _matrix(n: int, k: int, seed: int = 0, std: float = 0.05) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * std).bfloat16()


def test_round_trip_is_exact_including_rows_stored_whole():
    w = _matrix(40, 192)
    w[0, 5] = 0.0  # an exact zero: 2^15+ below the row's largest, so the row is stored whole
    w[1, 7] = -0.0
    w[2, 9] = float("inf")
    w[3, 0] = float("nan")
    w[4, 3] = 1e-39  # a subnormal
    w[5] = torch.full((192,), 3.0).bfloat16()  # a constant row fits the window
    w[6, :] = (torch.arange(192) - 96).bfloat16() * 1e3  # a wide row (with its zero): stored whole
    data = b12.encode(w)
    assert data.dtype == torch.uint8 and data.dim() == 1
    raw = b12.raw_rows(w)
    assert raw >= 6 and data.numel() == b12.coded_nbytes(40, 192, raw)
    back = b12.decode(data, 40, 192)
    assert torch.equal(_bits(back), _bits(w))
    assert torch.equal(_bits(b12.decode_rows(data, 40, 192, 3, 9)), _bits(w[3:9]))
    plain = _matrix(64, 1024)  # normal values at a weight's scale: few rows stored whole, ~0.76 of the bytes
    assert b12.encode(plain).numel() < 0.82 * plain.numel() * 2


def test_shapes_the_coding_does_not_take_are_refused():
    for w in (torch.zeros(4, 96, dtype=torch.bfloat16), torch.zeros(4, 64), torch.zeros(64, dtype=torch.bfloat16)):
        assert not b12.supported(tuple(w.shape), w.dtype)
        with pytest.raises(ValueError, match="b12 codes"):
            b12.encode(w)


@native
def test_native_decode_matches():
    w = _matrix(33, 128, seed=3)
    w[4, 0] = 0.0
    data = b12.encode(w)
    out = torch.empty(33, 128, dtype=torch.bfloat16)
    cpu.required().ms_b12_decode(data.data_ptr(), 33, 128, out.data_ptr())
    assert torch.equal(_bits(out), _bits(w))


def _experts(n: int, inter: int, k: int, d: int) -> list[list[torch.Tensor]]:
    out = []
    for e in range(n):
        ms = [_matrix(inter, k, 10 * e), _matrix(inter, k, 10 * e + 1), _matrix(d, inter, 10 * e + 2)]
        ms[e % 3][e, 1] = 0.0  # some rows of some matrices stored whole
        out.append(ms)
    return out


@native
@pytest.mark.parametrize("tokens", [1, 3, 8, 20, 40, 100])
def test_glu_on_coded_experts_sums_exactly_as_on_bf16(tokens):
    """Every kernel the grouped GLU call picks by rows an expert (one-row GEMV, tiles, GEMM, panels) gives the
    same bits from the coded bytes as from the bf16 matrices, at 1 and 2 threads."""
    inter, k, d, n = 128, 256, 192, 4
    ws = _experts(n, inter, k, d)
    codes = [[b12.encode(m) for m in w] for w in ws]
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, k, generator=g)
    ids = torch.stack([torch.randperm(n, generator=g)[:2] for _ in range(tokens)])
    scores = torch.rand(tokens, 2, generator=g)
    before = cpu.threads()
    try:
        for threads in (1, 2):
            cpu.set_threads(threads)
            ref, got = torch.zeros(tokens, d), torch.zeros(tokens, d)
            fused.moe_glu_bf16(x, list(range(n)), [tuple(m.data_ptr() for m in w) for w in ws], inter, ref, ids,
                               scores)
            fused.moe_glu_bf16(x, list(range(n)), [tuple(c.data_ptr() | 1 for c in w) for w in codes], inter, got,
                               ids, scores)
            assert torch.equal(ref, got), threads
            # the bf16 compute path (_cpu_bf16.c) decodes each unit's rows once: the same bits as its bf16 twin
            rb, gb = torch.zeros(tokens, d), torch.zeros(tokens, d)
            fused.moe_glu_bf16(x, list(range(n)), [tuple(m.data_ptr() for m in w) for w in ws], inter, rb, ids,
                               scores, compute="bf16")
            fused.moe_glu_bf16(x, list(range(n)), [tuple(c.data_ptr() | 1 for c in w) for w in codes], inter, gb,
                               ids, scores, compute="bf16")
            assert torch.equal(rb, gb)
            assert not torch.equal(rb, ref)  # (it is the other kernel)
            # the batch-invariant per-pair form
            pr, pg = torch.zeros(tokens, 2, d), torch.zeros(tokens, 2, d)
            fused.moe_glu_bf16(x, list(range(n)), [tuple(m.data_ptr() for m in w) for w in ws], inter, pr, ids,
                               scores)
            fused.moe_glu_bf16(x, list(range(n)), [tuple(c.data_ptr() | 1 for c in w) for w in codes], inter, pg,
                               ids, scores)
            assert torch.equal(pr, pg)
    finally:
        cpu.set_threads(before)


def test_b12_weight_linear_and_rows():
    w = _matrix(100, 128, seed=7)
    w[3, 3] = 0.0
    bw = b12.B12Weight.wrap(b12.encode(w), (100, 128))
    x = torch.randn(5, 128)
    assert torch.equal(bw.rows(10, 20), w[10:20].float())
    assert torch.allclose(bw.linear(x), x @ w.float().T, rtol=1e-5, atol=1e-6)
    assert bw.linear(x.view(5, 1, 128)).shape == (5, 1, 100)


def _to_bf16(path: Path) -> None:
    """Rewrite a checkpoint's shards in bf16 (how Qwen3-MoE and Mixtral are published; transformers saves fp32)."""
    from safetensors.torch import load_file, save_file

    for f in path.glob("*.safetensors"):
        save_file({k: v.bfloat16() for k, v in load_file(f).items()}, f, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def coded(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"b12_{request.param}")
    src, dst = root / "src", root / "dst"
    (_qwen if request.param == "qwen3_moe" else _mixtral)(src)
    _to_bf16(src)
    assert main(["pack", str(src), str(dst), "--codec", "b12", "--verify"]) == 0
    return src, dst


def assert_same_outputs(src: Path, dst: Path) -> None:
    """A pack's warm logits, and its greedy tokens under a budget that evicts, bit for bit the original's."""
    ids = prompt_ids(VOCAB, 32)
    warm = {}
    for path in (src, dst):
        eng = Engine.open(path)
        eng.logits(ids)
        warm[path] = eng.logits(ids)
    assert torch.equal(warm[src], warm[dst])
    got = {}
    for path in (src, dst):
        eng = Engine.open(path, ram_budget=_budget(src))
        got[path] = eng.generate(ids, 12, stop_token_ids=[])
        assert eng.stats["expert_evictions"] > 0, "the budget was meant to force evictions"
    assert got[src] == got[dst]


def test_coded_pack_logits_and_tokens_are_the_originals(coded):
    src, dst = coded
    manifest = json.loads((dst / PACK_MANIFEST).read_text())
    parts = [p for e in manifest["experts"] for p in e["parts"]]
    assert parts and all(p.get("codec") == "b12" for p in parts)
    assert sum(p["nbytes"] for p in parts) < 0.85 * sum(2 * p["shape"][0] * p["shape"][1] for p in parts)
    # experts of one shape padded to one length (pack._lay_out): their read buffers recycle
    assert len({e["length"] for e in manifest["experts"]}) == 1
    assert len({sum(p["nbytes"] for p in e["parts"]) for e in manifest["experts"]}) > 1
    # the lm_head and the attention projections are coded too, and load as B12Weights of the same values
    dense = manifest["dense_codec"]
    assert "lm_head.weight" in dense and "model.layers.0.self_attn.o_proj.weight" in dense
    assert not any("embed" in n or "norm" in n or "gate.weight" in n for n in dense)
    a, b = CheckpointIndex.open(src), CheckpointIndex.open(dst)
    for n in a.names():
        assert (a[n].dtype, a[n].shape) == (b[n].dtype, b[n].shape), n
        got = b.load(n)
        if n in dense:
            assert type(got) is b12.B12Weight and b[n].nbytes < 0.8 * a[n].nbytes, n
            got = cpu.b12_decode_rows(got.codes, *a[n].shape, 0, a[n].shape[0])
        assert torch.equal(a.load(n), got), n  # a coded expert tensor loads decoded, bit for bit
    assert_same_outputs(src, dst)


def test_info_names_a_packs_coding(coded, capsys):
    """`moestream info` of a coded pack says so next to the (coded) size of an expert and its dense bytes; the
    original says nothing."""
    from moestream.info import model_info

    src, dst = coded
    assert model_info(src).expert_codec is None and model_info(dst).expert_codec == "b12"
    assert model_info(dst).bytes_per_expert < model_info(src).bytes_per_expert
    for path, coded_ in ((src, False), (dst, True)):
        assert main(["info", str(path)]) == 0
        out = capsys.readouterr().out.splitlines()
        line = next(ln for ln in out if ln.startswith("experts:"))
        assert ("b12-coded" in line) == coded_, line
        dense = next(ln for ln in out if ln.startswith("dense bytes:"))  # and of its coded dense matrices
        assert ("b12-coded matrices" in dense) == coded_, dense
    n, nbytes, bf16 = model_info(dst).dense_coded
    assert n >= 2 and 0 < nbytes < bf16 and model_info(src).dense_coded == (0, 0, 0)


def test_damaged_coded_manifest_is_refused(coded, tmp_path):
    _, dst = coded
    bad = tmp_path / "bad"
    shutil.copytree(dst, bad)
    manifest = json.loads((dst / PACK_MANIFEST).read_text())
    manifest["experts"][0]["parts"][0]["nbytes"] = 10  # smaller than any coding of its shape
    (bad / PACK_MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"\(BF16\[.*\], b12\) is not fully described"):
        CheckpointIndex.open(bad)
    manifest = json.loads((dst / PACK_MANIFEST).read_text())
    name = manifest["experts"][0]["parts"][0]["tensor"]
    manifest["tensors"][name]["codec"] = "zstd"
    (bad / PACK_MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="zstd"):
        CheckpointIndex.open(bad)
    # a coded dense matrix whose stated shape or codec does not fit its stored bytes
    for key, value in (("shape", [8, 64]), ("codec", "zstd"), ("dtype", "F16")):
        manifest = json.loads((dst / PACK_MANIFEST).read_text())
        manifest["dense_codec"]["lm_head.weight"][key] = value
        (bad / PACK_MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(CheckpointError, match="coded dense tensor 'lm_head.weight'"):
            CheckpointIndex.open(bad)
    manifest["dense_codec"]["lm_head.weight"] = {"shape": [64, 64]}
    (bad / PACK_MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="malformed pack manifest"):
        CheckpointIndex.open(bad)


def test_a_coded_pack_is_not_packed_again(coded, tmp_path):
    _, dst = coded
    with pytest.raises(MoestreamError, match="already coded"):
        pack(dst, tmp_path / "again", codec="b12")
    assert not (tmp_path / "again").exists()

def test_a_pack_with_coded_dense_tensors_only_is_not_packed_again(tmp_path):
    """fp32 experts (not coded) beside bf16 dense weights: only the lm_head and attention are coded; packing that
    again would copy coded bytes under a bf16 header, so it is refused."""
    from safetensors.torch import load_file, save_file

    src, dst = tmp_path / "src", tmp_path / "dst"
    _qwen(src)
    for f in src.glob("*.safetensors"):
        save_file({k: v if ".experts." in k else v.bfloat16() for k, v in load_file(f).items()}, f,
                  metadata={"format": "pt"})
    pack(src, dst, codec="b12")
    manifest = json.loads((dst / PACK_MANIFEST).read_text())
    assert "lm_head.weight" in manifest["dense_codec"] and not any("codec" in t for t in manifest["tensors"].values())
    with pytest.raises(MoestreamError, match="dense tensors are already coded"):
        pack(dst, tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_pack_codec_option_is_validated(tmp_path):
    with pytest.raises(SystemExit):
        main(["pack", str(tmp_path / "a"), str(tmp_path / "b"), "--codec", "zip"])


@native
def test_few_token_products_decode_in_registers_with_the_tiles_sums():
    """2-15 tokens through a coded expert (b12_rows_few: each block decoded in registers for all the tokens, two
    rows a pass) give bf16_tile's bits: every token count over the 8-token tiles' remainders, rows stored whole
    next to each other, alone and last, and the GEMM's 16 and 17 tokens beside them."""
    inter, k, d = 128, 128, 64
    ws = [_matrix(inter, k, 1), _matrix(inter, k, 2), _matrix(d, inter, 3)]
    for m in ws:  # rows stored whole: a pair, a lone one, the last
        for r in (1, 2, 7, m.shape[0] - 1):
            m[r, 0] = 0.0
    codes = [b12.encode(m) for m in ws]
    assert all(b12.raw_rows(m) >= 4 for m in ws)
    g = torch.Generator().manual_seed(5)
    for tokens in range(2, 18):
        x = torch.randn(tokens, k, generator=g)
        ref, got = torch.zeros(tokens, d), torch.zeros(tokens, d)
        fused.moe_glu_bf16(x, [0], [tuple(m.data_ptr() for m in ws)], inter, ref)
        fused.moe_glu_bf16(x, [0], [tuple(c.data_ptr() | 1 for c in codes)], inter, got)
        assert torch.equal(ref, got), tokens


@native
def test_coded_dense_weights_streamed_and_in_one_call_decode_equal_the_original(tmp_path, monkeypatch):
    """`pack --codec b12` codes the lm_head and the attention projections: resident (the one-call decode layer
    reads the coded q/k/v/o, one of them with exceptions), and at the budget's floor, where the coded head streams
    in slabs of a few rows (rows stored whole among them, their offsets rewritten per slab) and the layers stream,
    logits and tokens are the original's bit for bit and the budget holds."""
    from safetensors.torch import load_file, save_file

    from moestream.engine import residency
    from moestream.engine.engine import plan
    from moestream.engine.residency import plan_residency

    src, dst = tmp_path / "src", tmp_path / "dst"
    _qwen(src)
    _to_bf16(src)
    for f in src.glob("*.safetensors"):  # rows the coding must store whole: in the head and in a q_proj
        t = load_file(f)
        for name, row in (("lm_head.weight", 37), ("lm_head.weight", 38),
                          ("model.layers.1.self_attn.q_proj.weight", 5)):
            if name in t:
                t[name][row, 7] = 0.0
        if "model.layers.1.self_attn.o_proj.weight" in t:  # rows with a value or two far below the rest: b12x
            t["model.layers.1.self_attn.o_proj.weight"][10:36, 3] = 0.0
            t["model.layers.1.self_attn.o_proj.weight"][39, [0, 63]] = 0.0
        if "model.layers.0.self_attn.k_proj.weight" in t:  # every row stored whole: 1.75x its bf16 bytes
            t["model.layers.0.self_attn.k_proj.weight"][:, 3:43] = 0.0
        experts = sorted(n for n in t if ".experts." in n and n.startswith("model.layers.1."))
        if experts:  # and one expert tensor (every expert's part of it: too many misfits a row for exceptions)
            t[experts[0]][..., 3:43] = 0.0
            wide = experts[0]
        save_file(t, f, metadata={"format": "pt"})
    from moestream import pack as pack_module

    monkeypatch.setattr(pack_module, "CHUNK", 1280)  # dense matrices coded 10 rows at a time (rows stored whole apart)
    pack(src, dst, codec="b12")
    index = CheckpointIndex.open(dst)
    head = index["lm_head.weight"]
    original = CheckpointIndex.open(src).load("lm_head.weight")
    assert head.codec == "b12" and b12.raw_rows(original) >= 2
    assert torch.equal(index.load("lm_head.weight").codes, b12.encode(original))  # the slabs make the same bytes
    codecs = {n: c["codec"] for n, c in json.loads((dst / PACK_MANIFEST).read_text())["dense_codec"].items()}
    assert codecs["lm_head.weight"] == "b12" and codecs["model.layers.1.self_attn.o_proj.weight"] == "b12x"
    o_proj = CheckpointIndex.open(src).load("model.layers.1.self_attn.o_proj.weight")
    assert torch.equal(index.load("model.layers.1.self_attn.o_proj.weight").codes, b12.encode(o_proj, True))
    # a matrix the coding would not shrink by a tenth stays bf16 (pack.CODED_MAX)
    assert index["model.layers.0.self_attn.k_proj.weight"].codec is None
    assert index["model.layers.1.self_attn.k_proj.weight"].codec == "b12"
    assert index[wide].codec is None and index[experts[1]].codec == "b12"
    monkeypatch.setattr(residency, "HEAD_SLAB_BYTES", 2048)  # 20 rows a slab
    monkeypatch.setattr(residency, "EMBED_ROWS_BYTES", 1024)
    ids = prompt_ids(VOCAB, 24)
    want = Engine.open(src)
    want_logits, want_tokens = want.logits(ids), want.generate(ids, 8, stop_token_ids=[])
    p = plan(dst)
    floor = plan_residency(p, None, 1 << 20).min_ram_budget
    for budget in (None, floor):
        eng = Engine.open(dst, ram_budget=budget, state_room=1 << 20)
        assert torch.equal(eng.logits(ids), want_logits), budget
        assert eng.generate(ids, 8, stop_token_ids=[]) == want_tokens, budget
        if budget is None:
            assert type(eng.model.lm_head) is b12.B12Weight
            assert sum(layer.mixer.decode_blocks for layer in eng.model.layers) > 0  # the one-call layer ran
        else:
            assert eng.residency.head_streamed and eng.stats["peak_resident_bytes"] <= budget
            assert eng.stats["dense_stream_bytes_read"] > 0
        eng.close()


@native
@pytest.mark.parametrize("family", ["gpt_oss", "kimi_k3"])
def test_coded_pack_of_other_families_is_the_original(family, tmp_path):
    """gpt-oss (MXFP4 experts, bf16 attention with biases and sinks) and Kimi K3 (MXFP4 experts, MLA / KDA): only
    their dense matrices can be coded (gpt-oss's attention projections and head; K3's head, MLPs, KDA and MLA
    projections and latent projections); the model gives the original's logits and tokens bit for bit."""
    from safetensors.torch import load_file, save_file

    from test_pack import MAKERS

    src, dst = tmp_path / "src", tmp_path / "dst"
    MAKERS[family](src)
    for f in src.glob("*.safetensors"):  # dense weights in bf16, as published (the test model is written in fp32)
        save_file({k: v.bfloat16() if v.dtype == torch.float32 else v for k, v in load_file(f).items()}, f,
                  metadata={"format": "pt"})
    pack(src, dst, codec="b12")
    coded = set(json.loads((dst / PACK_MANIFEST).read_text()).get("dense_codec", {}))
    names = CheckpointIndex.open(src).names()
    want = {n for n in names if n.endswith("lm_head.weight")
            or (family == "gpt_oss" and any(n.endswith(f".self_attn.{p}_proj.weight") for p in "qkvo"))
            or CODED_MLP.fullmatch(n.removeprefix("language_model."))
            or (family == "kimi_k3" and CODED_K3.fullmatch(n.removeprefix("language_model."))
                and b12.supported(tuple(CheckpointIndex.open(src)[n].shape), torch.bfloat16))}
    # K3: the head, layer 0's dense MLP, each MoE layer's shared expert and latent projections, and the KDA / MLA
    # projections, those whose rows are a multiple of 64 values (not all are in the tiny model)
    if family == "gpt_oss":
        assert coded == want and len(want) == 1 + 4 * 3, sorted(coded)
    else:
        kinds = {n.split(".")[-2] for n in coded}
        assert coded == want and {"q_proj", "g_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa",
                                  "routed_expert_down_proj"} <= kinds, sorted(coded)
    ids = prompt_ids(64, 12)
    got = {}
    for path in (src, dst):
        eng = Engine.open(path)
        got[path] = (eng.logits(ids), eng.generate(ids, 6, stop_token_ids=[]))
    assert torch.equal(got[src][0], got[dst][0]) and got[src][1] == got[dst][1]
