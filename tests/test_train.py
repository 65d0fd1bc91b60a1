"""The demo-model recipe at tiny scale: KDA chunking, learning, exact resume, official export, engine agreement."""
from __future__ import annotations

import dataclasses
import json
import struct

import pytest
import torch

from moestream.train import data
from moestream.train.export import (checkpoint_tensors, config_from_checkpoint, dims, export_checkpoint, inventory,
                                    load_checkpoint)
from moestream.train.kda import chunked_delta, naive_delta
from moestream.train.loop import TrainOptions, heldout_loss, train
from moestream.train.model import DemoK3
from moestream.plot import line_chart
from moestream.train.recipe import SIZES

TINY = SIZES["tiny"]


def _kda_inputs(b=2, t=37, h=3, dk=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=g), dim=-1)
    v = torch.randn(b, t, h, dv, generator=g)
    decay = -5 * torch.sigmoid(3 * torch.randn(b, t, h, dk, generator=g))  # spans near 0 to near the -5 bound
    beta = torch.sigmoid(torch.randn(b, t, h, generator=g))
    return q, k, v, decay, beta


@pytest.mark.parametrize("chunk", [4, 16])
def test_chunked_kda_matches_the_recurrence_and_its_gradients(chunk):
    ins = [x.requires_grad_() for x in _kda_inputs()]
    want = naive_delta(*ins)
    grads_want = torch.autograd.grad(want.square().sum(), ins)
    got = chunked_delta(*ins, chunk=chunk)
    grads_got = torch.autograd.grad(got.square().sum(), ins)
    assert (got - want).abs().max() < 1e-5
    for a, b in zip(grads_got, grads_want):
        assert (a - b).abs().max() < 1e-4 * max(1.0, float(b.abs().max()))


def test_kda_survives_the_strongest_decay():
    q, k, v, _, beta = _kda_inputs(t=48)
    decay = torch.full_like(q, -4.999)
    got, want = chunked_delta(q, k, v, decay, beta, chunk=16), naive_delta(q, k, v, decay, beta)
    assert torch.isfinite(got).all() and (got - want).abs().max() < 1e-5


def test_mla_layers_follow_k3():
    assert dataclasses.replace(TINY, num_layers=8).mla_layers == [3, 6, 7]
    assert SIZES["demo"].mla_layers == [3, 6, 7] and SIZES["demo"].num_experts >= 64


def test_split_and_batches_are_deterministic():
    text = "".join(f"line {i}\n" for i in range(20000))
    train_text, held = data.split_text(text)
    assert train_text and held and len(train_text) + len(held) == len(text)
    tokens = torch.arange(5000, dtype=torch.int32)
    a, b = data.batch(tokens, 7, 4, 16, seed=1), data.batch(tokens, 7, 4, 16, seed=1)
    assert torch.equal(a, b) and a.shape == (4, 17) and not torch.equal(a, data.batch(tokens, 8, 4, 16, seed=1))
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(4, 16, dtype=torch.long))  # contiguous windows


@pytest.fixture(scope="module")
def corpus_text():
    from moestream.bpe import default_training_text

    return default_training_text(300_000)


def _options(tmp_path, **kw) -> TrainOptions:
    base = dict(out_dir=tmp_path, steps=40, batch_size=4, seq_len=32, lr=1e-2, warmup=5, eval_every=1000,
                eval_windows=8, text_bytes=300_000, model=TINY, checkpoint_seconds=1e9)
    return TrainOptions(**{**base, **kw})


def _prepared(tmp_path, corpus_text, **kw) -> TrainOptions:
    opts = _options(tmp_path, **kw)
    data.prepare(tmp_path, opts.text_bytes, TINY.vocab_size, text=corpus_text)  # cached for train()
    return opts


def test_training_lowers_the_loss(tmp_path, corpus_text):
    opts = _prepared(tmp_path, corpus_text)
    model, run, _ = train(opts, progress=False)
    first = sum(loss for _, loss in run.losses[:5]) / 5
    last = sum(loss for _, loss in run.losses[-5:]) / 5
    assert run.step == 40 and last < first - 1.0
    assert (tmp_path / "loss_curve.png").is_file() and len(run.evals) == 1
    biases = [m.gate.e_score_correction_bias for m in model.moe_layers()]
    assert all(b.abs().sum() > 0 for b in biases)  # the balancing moved the correction bias


def test_resume_continues_the_same_run(tmp_path, corpus_text):
    straight = _prepared(tmp_path / "a", corpus_text, steps=6)
    m1, r1, _ = train(straight, progress=False)
    split = _prepared(tmp_path / "b", corpus_text, steps=6)
    train(split, progress=False, stop_after=3)
    m2, r2, _ = train(split, progress=False)  # a new process would do exactly this: load train_state.pt
    assert r2.step == 6 and [x for _, x in r2.losses] == pytest.approx([x for _, x in r1.losses], abs=1e-6)
    for (n, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-6), n


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, corpus_text):
    from moestream.bpe import train_bpe_tokenizer

    out = tmp_path_factory.mktemp("tok")
    train_bpe_tokenizer(corpus_text.splitlines(keepends=True), TINY.vocab_size, out)
    return out


def test_export_writes_the_official_k3_layout(tmp_path, tokenizer_dir):
    from moestream.models.kimi_k3 import PREFIX, KimiK3Config
    from moestream.weights.index import CheckpointIndex

    model = DemoK3(TINY, seed=3)
    export_checkpoint(model, tokenizer_dir, tmp_path / "ckpt")
    raw = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert raw["model_type"] == "kimi_k3" and raw["text_config"]["model_type"] == "kimi_linear"
    assert raw["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert raw["text_config"]["linear_attn_config"]["full_attn_layers"] == [3, 4]  # 1-based: last two layers
    index = CheckpointIndex.open(tmp_path / "ckpt")
    want = inventory(KimiK3Config.from_hf(raw))
    assert sorted(index.names()) == sorted(PREFIX + n for n in want)
    for name, (shape, dtype) in want.items():
        info = index[PREFIX + name]
        assert (info.shape, info.dtype) == (tuple(shape), dtype), name
    assert index[PREFIX + "model.layers.1.block_sparse_moe.experts.0.w2.weight_packed"].dtype == "U8"
    assert index[PREFIX + "model.layers.0.self_attn.A_log"].dtype == "F32"
    assert (tmp_path / "ckpt" / "tokenizer.json").is_file() and (tmp_path / "ckpt" / "tokenizer_config.json").is_file()
    assert config_from_checkpoint(raw) == TINY
    names = [n for n, _ in checkpoint_tensors(model)]
    expert0 = [n for n in names if ".experts.0." in n and ".layers.1." in n]
    assert expert0 == [f"model.layers.1.block_sparse_moe.experts.0.{w}.weight_{k}" for w in ("w1", "w2", "w3")
                       for k in ("packed", "scale")]


def _round_to_bf16(model: DemoK3) -> DemoK3:
    """The training model with every weight the checkpoint stores in bf16 rounded to bf16."""
    fp32 = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias")
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not name.endswith(fp32):
                t.copy_(t.to(torch.bfloat16).float())
    return model


def _engine_or_skip():
    from moestream.models.registry import FAMILIES

    if "kimi_k3" not in FAMILIES:
        pytest.skip("the kimi_k3 inference family is not registered")
    from moestream import Engine

    return Engine


@pytest.mark.parametrize("quantize", [False, True])
def test_engine_runs_the_export_like_the_training_model(tmp_path, tokenizer_dir, quantize):
    Engine = _engine_or_skip()
    model = DemoK3(TINY, seed=5)
    export_checkpoint(model, tokenizer_dir, tmp_path / "ckpt", quantize=quantize)
    ref = load_checkpoint(tmp_path / "ckpt") if quantize else _round_to_bf16(model).eval()
    ids = torch.randint(0, TINY.vocab_size, (1, 41), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids)[0]
    eng = Engine.open(tmp_path / "ckpt")
    got = eng.logits(ids[0].tolist())
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    loss_engine = torch.nn.functional.cross_entropy(got[:-1], ids[0, 1:])
    assert float(loss_engine) == pytest.approx(heldout_loss(ref, ids), rel=1e-4)


def test_mxfp4_export_costs_little(tmp_path, tokenizer_dir):
    model = DemoK3(TINY, seed=7).eval()
    export_checkpoint(model, tokenizer_dir, tmp_path / "q")
    back = load_checkpoint(tmp_path / "q")
    w = model.model.layers[1].block_sparse_moe.experts.w1.detach()
    wq = back.model.layers[1].block_sparse_moe.experts.w1.detach()
    assert float((w - wq).norm() / w.norm()) < 0.2  # E2M1 with a shared power-of-two scale per 32
    ids = torch.randint(0, TINY.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    assert heldout_loss(back, ids) == pytest.approx(heldout_loss(model, ids), rel=0.02)


def test_dims_roundtrip_and_png(tmp_path):
    assert dims(TINY).experts == TINY.num_experts
    line_chart([[(0, 5.0), (10, 3.0), (20, 2.5)], [(10, 3.2)]], tmp_path / "c.png", width=200, height=120)
    raw = (tmp_path / "c.png").read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", raw[16:24]) == (200, 120)


def test_wsd_schedule_lets_a_run_change_its_length_before_the_decay(tmp_path):
    from moestream.train.loop import lr_at

    long, short = _options(tmp_path, steps=1000, decay_steps=100), _options(tmp_path, steps=500, decay_steps=100)
    assert [lr_at(long, s) for s in range(400)] == [lr_at(short, s) for s in range(400)]
    assert lr_at(short, 0) < lr_at(short, 100) == short.lr
    assert lr_at(short, 499) == pytest.approx(short.lr * (short.min_lr_ratio + (1 - short.min_lr_ratio) / 100))


def test_a_signal_stops_training_between_steps():
    import os
    import signal

    from moestream.train.loop import StopRequest

    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested
    assert signal.getsignal(signal.SIGTERM) == before


def test_the_shipped_demo_model_streams_under_a_budget_below_its_experts():
    Engine = _engine_or_skip()
    from moestream.demo_model import PROMPTS, path
    from moestream.engine.engine import plan
    from moestream.tokenizer import Tokenizer

    root = path()  # ships in the package: missing data is a failure, not a skip
    p = plan(root)
    assert p.layout.num_experts >= 64 and len(p.layout.moe_layers) >= 7 and p.layout.top_k > 1
    budget = p.dense_bytes + p.scratch_bytes + p.expert_bytes // 4
    eng = Engine.open(root, ram_budget=budget)
    tok = Tokenizer.load(root)
    out = eng.generate(tok.encode(PROMPTS[0]), 12, stop_token_ids=[])
    s = eng.stats
    assert len(out) == 12 and s["expert_evictions"] > 0 and s["peak_resident_bytes"] <= budget
    assert sum(f.stat().st_size for f in root.iterdir()) < 40 * 2**20
