"""Naive fp64 reference of the Kimi K3 text model, written from spec/kimi-k3.md alone (no moestream code).

Loads every `language_model.` tensor of a small checkpoint into float64 (MXFP4 experts dequantised with this
file's own E2M1 table) and runs one token at a time: the KDA delta-rule recurrence and conv window, explicit
softmax over expanded MLA keys and values (no absorption), AttnRes exactly as the spec's numbered steps.
`Mutation` flags reproduce known misreadings so tests can show each mechanism moves the logits.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

PREFIX = "language_model."
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float64)


@dataclass(frozen=True)
class Mutation:
    """Deliberate misreadings of the spec (all False = the spec)."""

    seal_2l: bool = False  # seal when (2l) % block == 0 (counting sublayers)
    bias_in_weights: bool = False  # weigh experts by the biased scores
    silu: bool = False  # SiLU-GLU instead of SiTU-GLU
    no_latent_norm: bool = False  # skip routed_expert_norm
    alog_per_channel: bool = False  # A_log indexed by channel instead of by head


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed [out, in/2] uint8 (low nibble = even element), scale [out, in/32] E8M0 -> fp64 [out, in]."""
    p = packed.to(torch.int64)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(p.shape[0], -1)
    values = E2M1[codes]
    factor = torch.pow(2.0, scale.to(torch.float64) - 127.0)
    return values * factor.repeat_interleave(32, dim=1)


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All language-model tensors, fp64, without the prefix; experts' packed pairs become dense '.weight'."""
    raw: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                if name.startswith(PREFIX):
                    raw[name[len(PREFIX):]] = f.get_tensor(name)
    out: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name.endswith(".weight_scale"):
            continue
        if name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            out[base + ".weight"] = dequant_mxfp4(t, raw[base + ".weight_scale"])
        else:
            out[name] = t.to(torch.float64)
    return out


def rms(v: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps)
    return y * w if w is not None else y


def sigmoid(v: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-v))


def silu(v: torch.Tensor) -> torch.Tensor:
    return v * sigmoid(v)



class KDACache:
    """One layer's recurrent state: raw q/k/v inputs of earlier tokens (for the conv) and S [n, d_k, d_v]."""

    def __init__(self, n: int, d: int):
        self.inputs: list[list[torch.Tensor]] = [[], [], []]
        self.S = torch.zeros(n, d, d, dtype=torch.float64)


class MLACache:
    """One layer's expanded keys and values of earlier tokens, per head (no latent trickery)."""

    def __init__(self):
        self.k_nope: list[torch.Tensor] = []  # [nh, dn] each
        self.k_r: list[torch.Tensor] = []  # [dr] each, shared by all heads
        self.v: list[torch.Tensor] = []  # [nh, dv] each


class K3Reference:
    def __init__(self, path: str | Path, mutation: Mutation = Mutation()):
        path = Path(path)
        top = json.loads((path / "config.json").read_text())
        self.c = top["text_config"]
        self.w = load_tensors(path)
        self.m = mutation
        self.eps = self.c["rms_norm_eps"]
        self.mla_layers = {i - 1 for i in self.c["linear_attn_config"]["full_attn_layers"]}

    def W(self, name: str) -> torch.Tensor:
        return self.w[name]

    # ---- small pieces (x is one token's vector) ----------------------------------------------------------
    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.m.silu:
            return silu(gate) * up
        b, lb = self.c["activation_situ_beta"], self.c["activation_situ_linear_beta"]
        return (b * torch.tanh(gate / b) * sigmoid(gate)) * (lb * torch.tanh(up / lb))

    def mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        gate = self.W(p + ".gate_proj.weight") @ x
        up = self.W(p + ".up_proj.weight") @ x
        return self.W(p + ".down_proj.weight") @ self.glu(gate, up)

    def read(self, P: torch.Tensor, R: list[torch.Tensor], norm: str, proj: str) -> torch.Tensor:
        """AttnRes: softmax over candidates (R..., P) of RMS-normalised keys dotted with w_n * w_p."""
        query = self.W(norm) * self.W(proj)[0]  # [H]
        cands = R + [P]
        scores = torch.stack([rms(v, None, self.eps) @ query for v in cands])
        p = torch.softmax(scores, dim=0)
        out = torch.zeros_like(P)
        for i, v in enumerate(cands):
            out = out + p[i] * v
        return out

    # ---- mixers ----------------------------------------------------------------------------------------
    def conv_silu(self, history: list[torch.Tensor], u: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv: tap K-1 on the current token, tap K-1-j on the token j back (zero before 0)."""
        history.append(u)
        ksize = weight.shape[-1]
        out = torch.zeros_like(u)
        for back in range(ksize):
            if back < len(history):
                out = out + weight[:, 0, ksize - 1 - back] * history[-1 - back]
        return silu(out)

    def kda(self, x: torch.Tensor, p: str, st: KDACache) -> torch.Tensor:
        lac = self.c["linear_attn_config"]
        n, d = lac["num_heads"], lac["head_dim"]
        q, k, v = (self.conv_silu(st.inputs[i], self.W(f"{p}.{s}_proj.weight") @ x,
                                  self.W(f"{p}.{s}_conv1d.weight")).view(n, d) for i, s in enumerate("qkv"))
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * d ** -0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        f = self.W(p + ".f_b_proj.weight") @ (self.W(p + ".f_a_proj.weight") @ x)
        f = f.view(n, d) + self.W(p + ".dt_bias").view(n, d)
        a_log = self.W(p + ".A_log")
        rate = torch.exp(a_log[:d]).view(1, d) if self.m.alog_per_channel else torch.exp(a_log[:n]).view(n, 1)
        g = lac["gate_lower_bound"] * sigmoid(rate * f)  # [n, d] in (lb, 0)
        beta = sigmoid(self.W(p + ".b_proj.weight") @ x)  # [n]
        o = torch.zeros(n, d, dtype=torch.float64)
        for h in range(n):
            S = torch.diag(torch.exp(g[h])) @ st.S[h]
            S = S + beta[h] * torch.outer(k[h], v[h] - S.T @ k[h])
            st.S[h] = S
            o[h] = S.T @ q[h]
        gate = sigmoid(self.W(p + ".g_proj.weight") @ x).view(n, d)
        y = rms(o, self.W(p + ".o_norm.weight"), self.eps) * gate
        return self.W(p + ".o_proj.weight") @ y.reshape(n * d)

    def mla(self, x: torch.Tensor, p: str, st: MLACache) -> torch.Tensor:
        c = self.c
        nh, dn, dr, dv, r = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                             c["v_head_dim"], c["kv_lora_rank"])
        cq = rms(self.W(p + ".q_a_proj.weight") @ x, self.W(p + ".q_a_layernorm.weight"), 1e-6)
        q = (self.W(p + ".q_b_proj.weight") @ cq).view(nh, dn + dr)
        ckv = self.W(p + ".kv_a_proj_with_mqa.weight") @ x  # [r + dr]
        lat = rms(ckv[:r], self.W(p + ".kv_a_layernorm.weight"), 1e-6)
        kv = (self.W(p + ".kv_b_proj.weight") @ lat).view(nh, dn + dv)
        st.k_nope.append(kv[:, :dn])
        st.k_r.append(ckv[r:])  # never rotated
        st.v.append(kv[:, dn:])
        keys, rope_keys, values = torch.stack(st.k_nope), torch.stack(st.k_r), torch.stack(st.v)  # [L, ...]
        out = torch.zeros(nh, dv, dtype=torch.float64)
        for h in range(nh):
            scores = (keys[:, h] @ q[h, :dn] + rope_keys @ q[h, dn:]) * (dn + dr) ** -0.5  # [L]: causal by construction
            out[h] = torch.softmax(scores, dim=0) @ values[:, h]
        gate = sigmoid(self.W(p + ".g_proj.weight") @ x)
        return self.W(p + ".o_proj.weight") @ (out.reshape(nh * dv) * gate)

    # ---- feed-forward ----------------------------------------------------------------------------------
    def moe(self, x: torch.Tensor, p: str) -> torch.Tensor:
        c = self.c
        s = sigmoid(self.W(p + ".gate.weight") @ x)  # [E]
        biased = s + self.W(p + ".gate.e_score_correction_bias")
        ids = torch.topk(biased, c["num_experts_per_token"]).indices.tolist()
        chosen = biased[ids] if self.m.bias_in_weights else s[ids]
        wts = chosen / (chosen.sum() + 1e-20) * c["routed_scaling_factor"]
        z = self.W(p + ".routed_expert_down_proj.weight") @ x  # latent
        y = torch.zeros_like(z)
        for e, wt in zip(ids, wts):
            ep = f"{p}.experts.{e}"
            h = self.glu(self.W(ep + ".w1.weight") @ z, self.W(ep + ".w3.weight") @ z)
            y = y + wt * (self.W(ep + ".w2.weight") @ h)
        if not self.m.no_latent_norm:
            y = rms(y, self.W(p + ".routed_expert_norm.weight"), self.eps)
        y = self.W(p + ".routed_expert_up_proj.weight") @ y
        return y + self.mlp(x, p + ".shared_experts")

    # ---- the model -------------------------------------------------------------------------------------
    def seals(self, layer: int) -> bool:
        block = self.c["attn_res_block_size"]
        return (2 * layer) % block == 0 if self.m.seal_2l else layer % block == 0

    def new_caches(self) -> list:
        lac = self.c["linear_attn_config"]
        return [MLACache() if i in self.mla_layers else KDACache(lac["num_heads"], lac["head_dim"])
                for i in range(self.c["num_hidden_layers"])]

    def step(self, token: int, caches: list) -> torch.Tensor:
        """One token through the model (caches updated); returns its fp64 logits [vocab]."""
        P = self.W("model.embed_tokens.weight")[token]
        R: list[torch.Tensor] = []
        for layer in range(self.c["num_hidden_layers"]):
            p = f"model.layers.{layer}"
            a = self.read(P, R, p + ".self_attention_res_norm.weight", p + ".self_attention_res_proj.weight") \
                if R else P
            live: torch.Tensor | None = P
            if self.seals(layer):
                R = R + [P]
                live = None
            xin = rms(a, self.W(p + ".input_layernorm.weight"), self.eps)
            if layer in self.mla_layers:
                u = self.mla(xin, p + ".self_attn", caches[layer])
            else:
                u = self.kda(xin, p + ".self_attn", caches[layer])
            P = u if live is None else live + u
            b = self.read(P, R, p + ".mlp_res_norm.weight", p + ".mlp_res_proj.weight")
            xff = rms(b, self.W(p + ".post_attention_layernorm.weight"), self.eps)
            if layer < self.c["first_k_dense_replace"]:
                P = P + self.mlp(xff, p + ".mlp")
            else:
                P = P + self.moe(xff, p + ".block_sparse_moe")
        h = self.read(P, R, "model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight")
        h = rms(h, self.W("model.norm.weight"), self.eps)
        return self.W("lm_head.weight") @ h

    def logits(self, ids: list[int]) -> torch.Tensor:
        """fp64 [len(ids), vocab] causal logits."""
        caches = self.new_caches()
        return torch.stack([self.step(t, caches) for t in ids])

    def greedy(self, ids: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
        """(prompt logits [len(ids), vocab], n greedy tokens)."""
        caches = self.new_caches()
        rows = [self.step(t, caches) for t in ids]
        prompt_logits = torch.stack(rows)
        out: list[int] = []
        last = rows[-1]
        for i in range(n):
            out.append(int(last.argmax()))
            if i + 1 < n:
                last = self.step(out[-1], caches)
        return prompt_logits, out
