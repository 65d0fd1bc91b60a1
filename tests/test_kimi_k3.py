"""Kimi K3: parity with the independent fp64 reference (tests/k3_reference.py) on a tiny synthetic K3, one
mutation per K3 mechanism showing the parity check would catch it, the official layout read in place (vision
never read), and sizes from the real config.json."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import expert_budget, max_rel_diff, prompt_ids, synth_tiny
from k3_reference import K3Reference
from moestream import Engine
from moestream.engine.engine import plan
from moestream.models import kda as kda_mod
from moestream.models import blocks, kimi_k3, latent_moe
from moestream.models.blocks import sigmoid_topk, silu_glu
from moestream.synth.families import SpecialIds
from moestream.synth.kimi_k3 import REAL, k3_config

REAL_CONFIG = Path(__file__).parent / "data" / "kimi_k3_config.json"
N_PROMPT, N_GEN, TOL = 80, 24, 1e-3
STATE_HEADROOM = 256 * 1024  # KDA/MLA state and AttnRes snapshots of the tiny model, on top of expert_budget
MUTATION_MIN = 50 * TOL  # a mutated engine must miss the reference by at least this much


pytestmark = pytest.mark.usefixtures("one_thread")  # torch's threaded tanh stalls on two shared cores


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory) -> Path:
    return synth_tiny(tmp_path_factory, "kimi-k3")


@pytest.fixture(scope="module")
def reference(k3_dir) -> dict:
    torch.set_num_threads(1)
    ref = K3Reference(k3_dir)
    ids = prompt_ids(ref.c["vocab_size"], N_PROMPT)
    logits, greedy = ref.greedy(ids, N_GEN)
    return {"ref": ref, "ids": ids, "logits": logits, "greedy": greedy}


def budget(path: Path) -> int:
    vocab = json.loads((path / "config.json").read_text())["text_config"]["vocab_size"]
    return expert_budget(path, 0.3) + STATE_HEADROOM + N_PROMPT * vocab * 4  # + all-position logits (charged)


def open_engine(path: Path, **options) -> Engine:
    eng = Engine.open(path, ram_budget=budget(path), **options)
    torch.set_num_threads(1)  # Engine.open sizes the pool to the machine
    return eng


# ---- parity ----------------------------------------------------------------------------------------------
def test_tiny_k3_exercises_every_mechanism(k3_dir):
    cfg = kimi_k3.KimiK3Config.from_hf(json.loads((k3_dir / "config.json").read_text()))
    seals = [i for i in range(cfg.num_layers) if i % cfg.block == 0]
    assert len(seals) >= 3, "several AttnRes blocks"
    assert cfg.mla_layers[-2:] == [cfg.num_layers - 2, cfg.num_layers - 1], "the last two layers are MLA"
    assert cfg.kda_layers and cfg.quantized and cfg.first_dense == 1
    assert N_PROMPT > 64, "the prompt crosses a KDA chunk boundary"


def test_parity_with_fp64_reference(k3_dir, reference):
    eng = open_engine(k3_dir)
    got = eng.logits(reference["ids"])
    rel = max_rel_diff(got, reference["logits"])
    assert got.shape == reference["logits"].shape and got.dtype == torch.float32
    assert rel < TOL, f"max relative logit difference {rel:.2e}"
    assert eng.generate(reference["ids"], N_GEN, stop_token_ids=[]) == reference["greedy"]
    s = eng.stats
    assert s["expert_evictions"] > 0, "the budget was meant to force evictions"
    assert s["peak_resident_bytes"] <= budget(k3_dir)
    print(f"\nK3 tiny parity: max rel logit diff {rel:.2e}, {N_GEN} greedy tokens identical, "
          f"evictions {s['expert_evictions']}, hit rate {s['expert_hit_rate']:.2f}")


def test_chunked_prefill_and_batched_steps_match_reference(k3_dir, reference):
    """Prefill in 13-token steps (state carried across KDA chunks, MLA cache, AttnRes per row) and two
    sequences of different lengths in one step."""
    eng = open_engine(k3_dir, prefill_chunk=13)
    assert max_rel_diff(eng.logits(reference["ids"]), reference["logits"]) < TOL
    short = prompt_ids(reference["ref"].c["vocab_size"], 9, seed=5)
    want_short = reference["ref"].logits(short)
    a, b = eng.new_sequence(), eng.new_sequence()
    out_a, out_b = eng.step([(a, reference["ids"][:40]), (b, short)], all_logits=True)
    assert max_rel_diff(out_a, reference["logits"][:40]) < TOL
    assert max_rel_diff(out_b, want_short) < TOL
    (next_a, next_b) = eng.step([(a, reference["ids"][40:41]), (b, [reference["ids"][0]])])
    assert max_rel_diff(next_a, reference["logits"][40]) < TOL
    eng.free(a), eng.free(b)


# ---- each mechanism matters: a mutated engine misses the reference by far more than the tolerance ----------
def _seal_2l(monkeypatch):
    monkeypatch.setattr(kimi_k3, "seals_at", lambda layer, block: (2 * layer) % block == 0)


def _bias_in_weights(monkeypatch):
    def route(self, x):  # K3's router is the only SigmoidRouter of this model
        logits = blocks.linear(x, self.weight)
        ids, _ = sigmoid_topk(logits, self.bias, self.top_k, True, self.scale)
        w = (torch.sigmoid(logits.float()) + self.bias.float()).gather(1, ids)
        return ids, w / (w.sum(-1, keepdim=True) + 1e-20) * self.scale

    monkeypatch.setattr(blocks.SigmoidRouter, "__call__", route)


def _silu(monkeypatch):
    # MXFP4 experts, shared experts and the dense layer all call blocks.situ_glu through blocks.Situ
    monkeypatch.setattr(blocks, "situ_glu", lambda gate, up, *args: silu_glu(gate.float(), up.float()))


def _no_latent_norm(monkeypatch):
    monkeypatch.setattr(latent_moe, "latent_norm", lambda y, w, eps: y)


def _a_log_per_channel(monkeypatch):
    init = kda_mod.KDAMixer.__init__

    def keep_full(self, w, prefix, opt):
        init(self, w, prefix, opt)
        self.full_a_log = w.get(f"{prefix}.A_log").reshape(-1)

    def decay(self, x):
        o = self.opt
        f = x @ self.f_a.float().T @ self.f_b.float().T
        f = f.view(x.shape[0], o.heads, o.head_dim) + self.dt_bias.float()
        rate = torch.exp(self.full_a_log[: o.head_dim].float()).view(1, o.head_dim)  # by channel: wrong
        return o.gate_lower_bound * torch.sigmoid(rate * f)

    monkeypatch.setattr(kda_mod.KDAMixer, "__init__", keep_full)
    monkeypatch.setattr(kda_mod.KDAMixer, "decay", decay)


MUTATIONS = {"seal_at_2l": _seal_2l, "bias_in_weights": _bias_in_weights, "silu_not_situ": _silu,
             "latent_norm_dropped": _no_latent_norm, "a_log_per_channel": _a_log_per_channel}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutation_breaks_parity(name, k3_dir, reference, monkeypatch):
    MUTATIONS[name](monkeypatch)
    got = open_engine(k3_dir).logits(reference["ids"])
    rel = max_rel_diff(got, reference["logits"])
    print(f"\nmutation {name}: max rel logit diff {rel:.3f}")
    assert torch.isfinite(got).all()
    assert rel > MUTATION_MIN, f"{name} moved the logits by only {rel:.2e}: the parity test would not catch it"


def test_reference_flags_are_the_same_misreadings(k3_dir, reference, monkeypatch):
    """The reference's Mutation flags and the engine mutations above describe the same misreadings."""
    from k3_reference import Mutation

    ids = reference["ids"][:12]
    for name, flag in [("seal_at_2l", "seal_2l"), ("bias_in_weights", "bias_in_weights"), ("silu_not_situ", "silu"),
                       ("latent_norm_dropped", "no_latent_norm"), ("a_log_per_channel", "alog_per_channel")]:
        with monkeypatch.context() as m:
            MUTATIONS[name](m)
            got = open_engine(k3_dir).logits(ids)
        want = K3Reference(k3_dir, Mutation(**{flag: True})).logits(ids)
        assert max_rel_diff(got, want) < TOL, name


# ---- the official layout, read in place ------------------------------------------------------------------
def test_official_layout_in_place(k3_dir):
    cfg = json.loads((k3_dir / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3" and cfg["text_config"]["model_type"] == "kimi_linear"
    assert cfg["quantization_config"]["format"] == "mxfp4-pack-quantized"
    index = json.loads((k3_dir / "model.safetensors.index.json").read_text())["weight_map"]
    headers = {}
    for shard in sorted(set(index.values())):
        with safe_open(str(k3_dir / shard), framework="pt") as f:
            for n in f.keys():
                sl = f.get_slice(n)
                headers[n] = (tuple(sl.get_shape()), sl.get_dtype())
    text = {n: v for n, v in headers.items() if n.startswith(kimi_k3.PREFIX)}
    assert set(headers) - set(text) and all(n.startswith(kimi_k3.VISION) for n in set(headers) - set(text))
    c = kimi_k3.KimiK3Config.from_hf(cfg)
    want = dict(kimi_k3.top_tensors(c))
    for layer in range(c.num_layers):
        want.update(kimi_k3.layer_dense_tensors(c, layer))
        if layer in c.moe_layers:
            for e in range(c.num_experts):
                want.update(kimi_k3.expert_tensors(c, layer, e))
    assert {kimi_k3.PREFIX + n: (s, d) for n, (s, d) in want.items()} == text
    fp32 = {n for n, (_, d) in text.items() if d == "F32"}
    assert all(n.endswith(("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias"))
               for n in fp32)
    assert all(d == "U8" for n, (_, d) in text.items() if ".experts." in n)

    eng = open_engine(k3_dir)
    eng.logits([1, 2, 3])
    mixer = eng.model.layers[0].mixer
    assert mixer.A_log.dtype == torch.float32 and mixer.conv[0].dtype == torch.float32
    assert eng.model.layers[1].ffn.route.bias.dtype == torch.float32
    blobs = [v for v, _ in eng.runner.cache._items.values()]
    assert blobs and all(t.dtype == torch.uint8 for b in blobs for t in b.tensors().values()), \
        "experts stay packed in the cache"


def _add_vision_shard(path: Path) -> Path:
    """A whole shard of random bytes viewed as vision-tower bf16 (NaNs included), listed in the index."""
    g = torch.Generator().manual_seed(3)
    garbage = {f"vision_tower.encoder.blocks.{i}.mlp.fc{j}.weight":
               torch.randint(0, 256, (256, 512), generator=g, dtype=torch.uint8).view(torch.bfloat16)
               for i in range(2) for j in (1, 2)}
    shard = path / "model-vision-00001.safetensors"
    save_file(garbage, shard, metadata={"format": "pt"})
    idx_path = path / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    idx["weight_map"].update({n: shard.name for n in garbage})
    idx_path.write_text(json.dumps(idx))
    return shard


def test_vision_tensors_are_never_read(k3_dir, tmp_path, monkeypatch):
    path = tmp_path / "k3"
    path.mkdir()
    for f in k3_dir.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    vision_shard = _add_vision_shard(path)
    # every data read goes through os.open + os.preadv (headers are read with open() at Engine.open)
    fds: dict[int, str] = {}  # fd -> path now (fd numbers are reused after close)
    opened: list[str] = []
    reads: list[tuple[str, int, int]] = []
    real_open, real_preadv = os.open, os.preadv

    def spy_open(p, flags, *a, **k):
        fd = real_open(p, flags, *a, **k)
        fds[fd] = str(p)
        opened.append(str(p))
        return fd

    def spy_preadv(fd, buffers, offset, *a):
        n = real_preadv(fd, buffers, offset, *a)
        reads.append((fds.get(fd, "?"), offset, n))
        return n

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "preadv", spy_preadv)
    eng = open_engine(path)
    ids = prompt_ids(eng.vocab_size, 20)
    out = eng.generate(ids, 6, stop_token_ids=[])
    assert len(out) == 6 and reads
    assert str(vision_shard) not in opened, "the vision shard was opened for reading"
    # vision tensors inside language shards: only alignment slop (< 4 KiB) of an expert read may cover them
    idx = eng.plan.store.index
    for name in idx.names():
        if name.startswith(kimi_k3.VISION):
            info = idx[name]
            for file, off, n in reads:
                if file == str(info.file):
                    overlap = min(off + n, info.offset + info.nbytes) - max(off, info.offset)
                    assert overlap < 4096, f"a read covered {overlap} bytes of {name}"
    # every byte read is a dense weight or an expert byte counted in bytes_read (aligned runs may end past
    # EOF, so "<="): nothing else was fetched
    assert sum(n for _, _, n in reads) <= eng.stats["bytes_read"] + eng.stats["dense_bytes"]


# ---- configs and sizes -----------------------------------------------------------------------------------
def test_real_config_is_what_the_synth_builder_writes():
    real = json.loads(REAL_CONFIG.read_text())
    assert k3_config(REAL, SpecialIds(163584, 163586, 163839)) == real


def test_real_config_parses():
    c = kimi_k3.KimiK3Config.from_hf(json.loads(REAL_CONFIG.read_text()))
    assert c.mla_layers == list(range(3, 92, 4)) + [92] and len(c.kda_layers) == 69
    assert (c.hidden_size, c.num_experts, c.top_k, c.latent, c.block, c.scaling) == (7168, 896, 16, 3584, 12, 1.0)
    assert c.quantized and c.a_log_len == 128
    assert c.raw["eos_token_id"] == 163586


def test_sizes_from_real_config():
    s = kimi_k3.k3_sizes_from_config(json.loads(REAL_CONFIG.read_text()))
    assert s["bytes_per_expert"] == 17_547_264
    assert s["cold_expert_bytes_per_token"] == 16 * 92 * 17_547_264  # 25.8 GB
    assert abs(s["params"] / 1e12 - 2.78) < 0.01
    assert abs(s["active_params"] / 1e9 - 104) < 1
    assert abs(s["total_bytes"] / 1e12 - 1.56) < 0.01
    assert abs(s["expert_bytes"] / 1e12 - 1.45) < 0.01
    assert abs(s["dense_bytes"] / 1e9 - 114) < 1
    assert (s["mla_layers"], s["kda_layers"], s["moe_layers"]) == (24, 69, 92)


def test_sizes_match_a_written_checkpoint(k3_dir):
    s = kimi_k3.k3_sizes_from_config(json.loads((k3_dir / "config.json").read_text()))
    p = plan(k3_dir)
    payload = [sum(loc.nbytes for loc in p.store.locate(layer, e))
               for layer in p.layout.moe_layers for e in range(s["num_experts"])]
    assert s["dense_bytes"] == p.dense_bytes
    assert s["expert_bytes"] == sum(payload) and set(payload) == {s["bytes_per_expert"]}
    assert s["num_tensors"] == sum(1 for n in p.store.index.names() if n.startswith(kimi_k3.PREFIX))


def test_unsupported_configs_are_clear_errors():
    from moestream.errors import UnsupportedModelError

    real = json.loads(REAL_CONFIG.read_text())
    for key, value in [("hidden_act", "silu"), ("num_expert_group", 8), ("rope_theta", 10000.0)]:
        bad = json.loads(json.dumps(real))
        bad["text_config"][key] = value
        with pytest.raises(UnsupportedModelError):
            kimi_k3.KimiK3Config.from_hf(bad)
    bad = json.loads(json.dumps(real))
    bad["quantization_config"]["format"] = "nvfp4-pack-quantized"
    bad["quantization_config"]["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized"
    with pytest.raises(UnsupportedModelError):
        kimi_k3.KimiK3Config.from_hf(bad)
