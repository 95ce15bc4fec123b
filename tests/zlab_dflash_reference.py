"""Test-only reference: z-lab's `DFlashDraftModel` forward, re-implemented here in plain torch.

z-lab/dflash is not on PyPI and CI reaches only PyPI, so this file restates what its
`dflash/model.py` (commit 44947fbf71114e241c96de194f4b382b5dd330d0, read for docs/serving.md)
does when it loads a folder and drafts one block, as draftsmith's own code, independent of
models/dflash.py:

- config: a Qwen3 config.json with `block_size` and `dflash_config.{target_layer_ids,
  mask_token_id}`; head_dim from config (else hidden // heads); never causal.
- weights: `layers.{i}.self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`, `mlp.{gate,up,down}_proj`,
  `{input,post_attention}_layernorm`, `norm`, `fc`, `hidden_norm`, all required, nothing else.
- context: `hidden_states[id + 1]` of the target for each id, in the listed order, through
  `hidden_norm(fc(.))`; K/V from [context; block] (k_norm and RoPE on every key), queries from
  the block only, positions 0..ctx+B-1; logits = the target's head on `norm(out)[1:]`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

LAYER_TENSORS = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]


def _rms(x, w, eps):  # Qwen3RMSNorm: statistics in float32, weight applied after casting back
    dtype = x.dtype
    x = x.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class ZlabDFlashReference:
    def __init__(self, folder: str | Path):
        folder = Path(folder)
        self.config = c = json.loads((folder / "config.json").read_text())
        d = c["dflash_config"]
        self.target_layer_ids, self.mask_token_id, self.block_size = d["target_layer_ids"], d["mask_token_id"], c["block_size"]
        self.eps, self.nh, self.nkv = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.nh
        self.theta = c.get("rope_theta", 10000.0)
        if c.get("rope_scaling"):
            raise NotImplementedError("the reference covers the default RoPE only")
        state = load_file(str(folder / "model.safetensors"))
        expected = {"norm.weight", "fc.weight", "hidden_norm.weight"} | {
            f"layers.{i}.{n}" for i in range(c["num_hidden_layers"]) for n in LAYER_TENSORS}
        if set(state) != expected:  # from_pretrained would report missing / unexpected keys
            raise KeyError(f"missing {sorted(expected - set(state))[:5]}, unexpected {sorted(set(state) - expected)[:5]}")
        self.w = {k: v.float() for k, v in state.items()}

    def context_feature(self, hidden_states: tuple) -> torch.Tensor:
        """extract_context_feature: hidden_states[id + 1] per id, concatenated in list order."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    def _attention(self, i, x, ctx, cos, sin):
        w, d, (b, q_len, _) = self.w, self.head_dim, x.shape
        p = f"layers.{i}.self_attn."
        q = _rms((x @ w[p + "q_proj.weight"].T).view(b, q_len, -1, d), w[p + "q_norm.weight"], self.eps).transpose(1, 2)
        kv_in = torch.cat([ctx, x], dim=1)
        k = _rms((kv_in @ w[p + "k_proj.weight"].T).view(b, kv_in.shape[1], -1, d), w[p + "k_norm.weight"], self.eps).transpose(1, 2)
        v = (kv_in @ w[p + "v_proj.weight"].T).view(b, kv_in.shape[1], -1, d).transpose(1, 2)
        q = q * cos[..., -q_len:, :] + _rotate_half(q) * sin[..., -q_len:, :]
        k = k * cos + _rotate_half(k) * sin
        k, v = (t.repeat_interleave(self.nh // self.nkv, dim=1) for t in (k, v))
        scores = (q @ k.transpose(-1, -2)) * d ** -0.5  # no mask: every block query sees all keys
        out = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
        return out.transpose(1, 2).reshape(b, q_len, -1) @ w[p + "o_proj.weight"].T

    def forward(self, noise_embedding, target_hidden, position_ids):
        """noise_embedding [b, B, H] (the target's embedding of the block), target_hidden
        [b, ctx, n*H], position_ids [b, ctx + B] → the draft's normed output [b, B, H]."""
        w, h = self.w, noise_embedding.float()
        ctx = _rms(target_hidden.float() @ w["fc.weight"].T, w["hidden_norm.weight"], self.eps)
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        freqs = position_ids[:, :, None].float() * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        for i in range(self.config["num_hidden_layers"]):
            p = f"layers.{i}."
            h = h + self._attention(i, _rms(h, w[p + "input_layernorm.weight"], self.eps), ctx, cos, sin)
            x = _rms(h, w[p + "post_attention_layernorm.weight"], self.eps)
            h = h + (torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        return _rms(h, w["norm.weight"], self.eps)
