"""Runtime model for Llama-family targets (Llama, Mistral, Qwen2, Qwen3) with a static KV cache.

gpt-fast style: preallocated cache buffers written by position, one forward for prefill,
decode and verify alike. Rows of a batch have their own positions, so ragged prompts need no
padding inside the cache: a query at position p attends to the keys at positions <= p of its
own row. Keys left behind by rejected drafts sit at positions beyond the row's length and are
overwritten before any query can reach them.

Shapes: B batch, q query tokens per row, S cache length, L layers, nh/nkv heads, d head dim.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from models.layers import GatedMLP, RMSNorm, apply_rope, rope_config, rope_cos_sin, rope_inv_freq

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}


@dataclass
class RuntimeConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qkv_bias: bool = False  # qwen2
    qk_norm: bool = False  # qwen3

    @classmethod
    def from_hf(cls, hf_config) -> "RuntimeConfig":
        kind = hf_config.model_type
        if kind not in SUPPORTED:
            raise ValueError(f"model_type {kind!r} has no runtime implementation ({', '.join(sorted(SUPPORTED))})")
        theta, scaling = rope_config(hf_config)
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=hf_config.num_attention_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=kind == "qwen3",
        )


class KVCache(nn.Module):
    """k, v [L, B, nkv, S, d], preallocated."""

    def __init__(self, cfg: RuntimeConfig, batch: int, max_len: int, dtype, device):
        super().__init__()
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


def cache_mask(positions: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B,1,q,S] bool: a query at position p sees the cache keys at positions <= p."""
    key_pos = torch.arange(max_len, device=positions.device)
    return (key_pos[None, None, :] <= positions[:, :, None])[:, None]


def cached_attention(q, k, v, k_cache, v_cache, positions, mask):
    """Write k, v [B,nkv,q,d] at `positions` [B,q] into the caches [B,nkv,S,d], then attend.

    q [B,nh,q,d] (nh a multiple of nkv); mask from `cache_mask`. Returns [B,nh,q,d].
    """
    B, nkv, n, d = k.shape
    index = positions[:, None, :, None].expand(B, nkv, n, d)
    k_cache.scatter_(2, index, k.to(k_cache.dtype))
    v_cache.scatter_(2, index, v.to(v_cache.dtype))
    return F.scaled_dot_product_attention(q, k_cache.to(q.dtype), v_cache.to(q.dtype), attn_mask=mask,
                                          enable_gqa=q.shape[1] != nkv)


class Attention(nn.Module):
    def __init__(self, cfg: RuntimeConfig):
        super().__init__()
        self.nh, self.nkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.nh * self.d, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x, cos, sin, positions, k_cache, v_cache, mask):
        """x [B,q,H]; positions [B,q]; k_cache/v_cache [B,nkv,S,d] of this layer; mask [B,1,q,S]."""
        B, q, _ = x.shape
        xq = self.q_proj(x).view(B, q, self.nh, self.d)
        xk = self.k_proj(x).view(B, q, self.nkv, self.d)
        xv = self.v_proj(x).view(B, q, self.nkv, self.d)
        if self.qk_norm:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        xq, xk = apply_rope(xq, cos, sin), apply_rope(xk, cos, sin)
        out = cached_attention(xq, xk, xv, k_cache, v_cache, positions, mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, q, self.nh * self.d))


class Block(nn.Module):
    def __init__(self, cfg: RuntimeConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, positions, k_cache, v_cache, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, k_cache, v_cache, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class RuntimeModel(nn.Module):
    def __init__(self, cfg: RuntimeConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), persistent=False)

    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype=torch.float32, device="cpu") -> "RuntimeModel":
        """Load an HF safetensors folder strictly: every tensor present, no stray ones."""
        from safetensors.torch import load_file
        from transformers import AutoConfig

        folder = Path(folder)
        cfg = RuntimeConfig.from_hf(AutoConfig.from_pretrained(folder))
        with torch.device("meta"):
            model = cls(cfg)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{folder} has no .safetensors weights")
        state = {}
        for f in files:
            for name, t in load_file(str(f)).items():
                state[name.removeprefix("model.")] = t
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        expected = {k for k in model.state_dict()} - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
        missing, unexpected = expected - set(state), set(state) - expected
        unexpected = {k for k in unexpected if not k.endswith("rotary_emb.inv_freq")}
        if missing or unexpected:
            raise KeyError(f"{folder}: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
        model.load_state_dict({k: state[k] for k in expected}, strict=False, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        return model.to(device=device, dtype=dtype).eval()

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.embed_tokens.weight
        return KVCache(self.config, batch, max_len, p.dtype, p.device)

    def forward(self, input_ids, positions, cache: KVCache, aux_layers: tuple = (), logits_at=None):
        """input_ids, positions [B,q] → (logits [B,q,V], aux [B,q,n*H] in aux_layers order or None).

        logits_at [B] (optional): compute the head only at this query index of each row
        (prefill needs one row of logits, not q of them); logits are then [B,1,V].

        Rows of a ragged step may carry padding tokens: they are written at positions beyond
        the row's real tokens, never attended by real queries, and overwritten later.
        """
        B, q = input_ids.shape
        mask = cache_mask(positions, cache.max_len)
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        captured = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, positions, cache.k[i], cache.v[i], mask)
            if i in aux_layers:
                captured[i] = x
        if logits_at is not None:
            x = x[torch.arange(B, device=x.device), logits_at][:, None]
        logits = self.lm_head(self.norm(x))
        return logits, (torch.cat([captured[i] for i in aux_layers], -1) if aux_layers else None)


class GraphedStep:
    """A CUDA graph of one fixed-shape forward (batch B, q query tokens) over a given cache.

    Decode and verify steps always have the same shapes, so their ~15 kernels per layer are
    launched by one graph replay instead of one Python call each. Inputs are copied into
    static buffers; the returned tensors are the graph's own outputs, overwritten by the next
    replay (copy what must outlive it).
    """

    def __init__(self, model: RuntimeModel, cache: KVCache, batch: int, q: int, aux_layers: tuple = ()):
        dev = model.embed_tokens.weight.device
        self.ids = torch.zeros(batch, q, dtype=torch.long, device=dev)
        self.positions = torch.zeros(batch, q, dtype=torch.long, device=dev)
        k_snapshot, v_snapshot = cache.k.clone(), cache.v.clone()  # warm-up writes into the cache
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):
                model(self.ids, self.positions, cache, aux_layers)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.logits, self.aux = model(self.ids, self.positions, cache, aux_layers)
        cache.k.copy_(k_snapshot)
        cache.v.copy_(v_snapshot)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor):
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.graph.replay()
        return self.logits, self.aux
