"""kimi_linear family: parity with transformers' KimiLinearForCausalLM (torch path), decode vs prefill, batching,
config parsing; and the MLA mixer against transformers' Kimi Linear and DeepSeek-V3 attention."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from conftest import FakeWeights, decode_logits, max_rel_diff, prompt_ids
from moestream import Engine
from moestream.memory.accountant import MemoryAccountant
from moestream.memory.state import Batch, SeqState
from moestream.errors import CheckpointError
from moestream.models.kimi_linear import FULL, LINEAR, KimiLinearConfig, layer_types
from moestream.models.mla import MLAMixer, MLAOptions

# conftest.reference_greedy calls generate(pad_token_id=0) without an attention mask, so transformers masks out
# every prompt token equal to 0 and the reference stops being causal LM over the prompt; this vocab size keeps 0
# out of the 75-token parity prompt.
VOCAB = 131

pytestmark = pytest.mark.skipif(importlib.util.find_spec("fla") is not None,
                                reason="the transformers reference must run its torch (non-fla) KDA path")


def tiny_config():
    from transformers import KimiLinearConfig as HFConfig

    # 6 layers, 1-based lists as in the published checkpoint: KDA 1, 3, 4, 6; MLA 2, 5 -> 0-based MLA 1, 4
    lac = {"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4, "full_attn_layers": [2, 5],
           "kda_layers": [1, 3, 4, 6]}
    return HFConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                    num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                    q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_experts=8,
                    num_experts_per_token=3, num_shared_experts=1, first_k_dense_replace=1,
                    linear_attn_config=lac, initializer_range=0.08, pad_token_id=0, bos_token_id=1,
                    eos_token_id=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, reference model): random weights, with norms, router bias and dt_bias moved off their init values."""
    from transformers import KimiLinearForCausalLM

    path = tmp_path_factory.mktemp("kimi_linear")
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(tiny_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    model.save_pretrained(path)
    return path, model


def test_layer_and_mlp_types_follow_the_checkpoint(tiny):
    from moestream.config import read_model_config

    cfg = KimiLinearConfig.from_hf(read_model_config(tiny[0]))
    assert cfg.layer_types == [LINEAR, FULL, LINEAR, LINEAR, FULL, LINEAR]
    assert cfg.moe_layers == [1, 2, 3, 4, 5] and cfg.num_experts == 8 and cfg.top_k == 3
    assert cfg.scaling == pytest.approx(2.446) and cfg.renormalize and cfg.shared_experts == 1


def test_parity_with_transformers(tiny, check_parity):
    path, ref = tiny
    assert 0 not in prompt_ids(VOCAB, 75)
    figures = check_parity(path, ref, VOCAB)
    print(f"kimi_linear parity: max rel logit diff {figures['max_rel_logit_diff']:.2e}, "
          f"evictions {figures['stats']['expert_evictions']}")


def test_decode_token_by_token_matches_prefill(tiny):
    eng = Engine.open(tiny[0])
    ids = prompt_ids(VOCAB, 75)
    want = eng.logits(ids)
    got = decode_logits(eng, ids)
    assert max_rel_diff(got, want) < 1e-4
    assert eng.memory.state_bytes == 0  # KDA fixed state and MLA latent caches all released


def test_two_sequences_in_one_step_match_each_alone(tiny):
    eng = Engine.open(tiny[0])
    a, b = prompt_ids(VOCAB, 70, seed=2), prompt_ids(VOCAB, 23, seed=3)
    alone = []
    for ids in (a, b):
        s = eng.new_sequence()
        alone.append((eng.step([(s, ids[:-1])], all_logits=True)[0], eng.step([(s, ids[-1:])])[0]))
        eng.free(s)
    sa, sb = eng.new_sequence(), eng.new_sequence()
    prefill = eng.step([(sa, a[:-1]), (sb, b[:-1])], all_logits=True)
    decode = eng.step([(sa, a[-1:]), (sb, b[-1:])])
    for i in range(2):
        assert max_rel_diff(prefill[i], alone[i][0]) < 1e-5
        assert max_rel_diff(decode[i], alone[i][1]) < 1e-5


def test_layer_types_from_lists_default_and_errors():
    base = {"num_hidden_layers": 6}
    lists = {"linear_attn_config": {"full_attn_layers": [4, 6], "kda_layers": [1, 2, 3, 5]}}
    assert layer_types({**base, **lists}) == [LINEAR, LINEAR, LINEAR, FULL, LINEAR, FULL]
    assert layer_types(base) == [LINEAR, LINEAR, LINEAR, LINEAR, FULL, LINEAR]  # transformers' default
    with pytest.raises(CheckpointError):
        layer_types({**base, "linear_attn_config": {"full_attn_layers": [7], "kda_layers": [1, 2, 3, 4, 5]}})
    with pytest.raises(CheckpointError):  # layer 6 is in neither list
        layer_types({**base, "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3, 5]}})


def test_checkpoint_style_config_names():
    """The published config spells MoE fields num_experts / num_experts_per_token / moe_renormalize."""
    c = {"model_type": "kimi_linear", "num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 100,
         "num_attention_heads": 4, "num_experts": 16, "num_experts_per_token": 4, "moe_renormalize": False,
         "num_shared_experts": 2, "routed_scaling_factor": 1.5, "first_k_dense_replace": 2,
         "moe_router_activation_func": "sigmoid", "linear_attn_config": {"num_heads": 4, "head_dim": 16,
         "short_conv_kernel_size": 3, "full_attn_layers": [4], "kda_layers": [1, 2, 3]}}
    cfg = KimiLinearConfig.from_hf(c)
    assert (cfg.num_experts, cfg.top_k, cfg.renormalize, cfg.shared_experts, cfg.scaling) == (16, 4, False, 2, 1.5)
    assert cfg.moe_layers == [2, 3] and cfg.kda.conv_kernel == 3 and cfg.kda.decay == "softplus"
    assert cfg.mla.rope is None and cfg.mla.q_lora_rank is None


def _hf_attention(kind: str):
    """(transformers attention module with random weights, MLAOptions, forward(x) -> reference output)."""
    if kind == "kimi":
        from transformers import KimiLinearConfig as HFConfig
        from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

        cfg = HFConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                       kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
        cfg._attn_implementation = "eager"
        att = KimiLinearAttention(cfg, 0).eval()
        return att, MLAOptions.from_hf(cfg.to_dict()), lambda x, mask: att(x, attention_mask=mask)[0]
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    from moestream.models.rope import build_rope

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
            "mscale_all_dim": 1.0, "rope_theta": 10000.0, "beta_fast": 32, "beta_slow": 1}
    cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
                           kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                           rope_interleave=True, rope_parameters=yarn, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    att, rot = DeepseekV3Attention(cfg, 0).eval(), DeepseekV3RotaryEmbedding(cfg)
    opts = MLAOptions.from_hf(cfg.to_dict(), rope=build_rope(cfg.to_dict(), 8, interleaved=True), scale=att.scaling)
    pos = torch.arange(40)[None]
    return att, opts, lambda x, mask: att(x, position_embeddings=rot(x, pos), attention_mask=mask)[0]


@pytest.mark.parametrize("kind", ["kimi", "deepseek"])
def test_mla_expanded_and_absorbed_match_transformers(kind):
    torch.manual_seed(0)
    att, opts, forward = _hf_attention(kind)
    for p in att.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(1, 40, 64)
    with torch.no_grad():
        want = forward(x, torch.full((40, 40), float("-inf")).triu(1)[None, None])[0]
    tensors = {f"attn.{k}": v.detach() for k, v in att.state_dict().items()}
    for mode in ("expand", "absorb", "auto"):
        opts.mode = mode
        mixer = MLAMixer(FakeWeights(tensors), "attn", opts)
        for splits in ([40], [7, 1, 1, 31]):
            state, outs = SeqState(MemoryAccountant(None), 1), []
            for n in splits:
                outs.append(mixer(x[0, state.pos:state.pos + n], Batch.build([(state, n)]), 0))
                state.pos += n
            assert max_rel_diff(torch.cat(outs), want) < 1e-5, (mode, splits)
            assert state.layers[0].latents.row_shape == (16 + 8,)  # only [c | k_r] is cached


def test_expert_layout_per_expert_and_fused():
    from moestream.models.kimi_linear import expert_layout

    cfg = KimiLinearConfig.from_hf({"num_hidden_layers": 3, "vocab_size": 10, "num_attention_heads": 2,
                                    "num_experts": 4, "num_experts_per_token": 2})
    per_expert = {"model.layers.1.block_sparse_moe.gate.weight"}
    parts = expert_layout(cfg, per_expert).parts
    assert [p.tensor for p in parts] == [f"model.layers.{{layer}}.block_sparse_moe.experts.{{expert}}.{w}.weight"
                                         for w in ("w1", "w3", "w2")]
    fused = {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.gate_up_proj"}
    parts = expert_layout(cfg, fused).parts
    assert [(p.name, p.tensor, p.fused) for p in parts] == [
        ("gate_up", "model.layers.{layer}.mlp.experts.gate_up_proj", True),
        ("down", "model.layers.{layer}.mlp.experts.down_proj", True)]


def test_config_errors_are_user_errors():
    from moestream.errors import MoestreamError

    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        KimiLinearConfig.from_hf({"vocab_size": 10})
    with pytest.raises(MoestreamError, match="router"):
        KimiLinearConfig.from_hf({"num_hidden_layers": 2, "vocab_size": 10, "num_attention_heads": 2,
                                  "moe_router_activation_func": "softmax"})
