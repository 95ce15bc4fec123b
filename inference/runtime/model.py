"""Runtime model for Llama-family targets (Llama, Mistral, Qwen2, Qwen3) and Gemma-3 (its parts in
inference/runtime/gemma.py) with a static KV cache.

gpt-fast style: preallocated cache buffers written by position, one forward for prefill,
decode and verify alike. Rows of a batch have their own positions, so ragged prompts need no
padding inside the cache: a query at position p attends to the keys at positions <= p of its
own row. Keys left behind by rejected drafts sit at positions beyond the row's length and are
overwritten before any query can reach them.

Shapes: B batch, q query tokens per row, S cache length, L layers, nh/nkv heads, d head dim.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith_kernels.dispatch import use_kernel
from draftsmith_kernels.decode_attention import (DECODE_MAX_QUERIES, cache_mask, decode_attention,  # noqa: F401 (re-exported)
                                      grouped_attention_bias, grouped_cache_attention)
from draftsmith_kernels.rms_norm import head_norm, rms_norm
from draftsmith_kernels.rope_cache import rope_cache
from draftsmith_kernels.settings import KernelSettings
from draftsmith_kernels.silu_mul import silu_mul
from draftsmith_kernels.tree_attention import tree_attention, tree_attention_reference, tree_cache_bias, with_root_row
from inference.runtime.gemma import (GEMMA_KINDS, embed_scale, gemma_fields, gemma_norm_weights, layer_rope,
                                     prefill_window_mask, sliding_layers, tree_window_bias)
from inference.runtime.hybrid import (HYBRID_KINDS, HybridCache, MambaBlock, hybrid_fields, hybrid_state,
                                      partial_inv_freq)
from models.layers import RMSNorm, rope_config, rope_inv_freq

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"} | GEMMA_KINDS | HYBRID_KINDS


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
    max_position_embeddings: int | None = None  # the context window (prompt + new tokens), where the config says
    # sliding-window layers (Gemma-3's local layers, Mistral): a query at p sees keys > p - window
    sliding_window: int | None = None
    local_layers: tuple = ()  # the windowed layers' indices
    local_rope_theta: float | None = None  # their RoPE base where it differs (Gemma-3), else rope_theta's
    local_rope_scaling: dict | None = None
    gemma: bool = False  # Gemma-3's layer (inference/runtime/gemma.py)
    query_scale: float | None = None  # query_pre_attn_scalar ** -0.5 where it is not head_dim ** -0.5
    final_logit_softcapping: float | None = None
    # hybrid targets (inference/runtime/hybrid.py): each layer's mixer, "attention" or "mamba"
    # (empty: every layer attends), the Mamba2 mixers' MambaShape, and a partial RoPE's rotated dims
    layer_kinds: tuple = ()
    mamba: object = None
    rotary_dim: int | None = None

    @classmethod
    def from_hf(cls, hf_config) -> "RuntimeConfig":
        kind = hf_config.model_type
        if kind not in SUPPORTED:
            raise ValueError(f"model_type {kind!r} has no runtime implementation ({', '.join(sorted(SUPPORTED))})")
        gemma = kind in GEMMA_KINDS
        theta, scaling = layer_rope(hf_config, "full_attention") if gemma else rope_config(hf_config)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        window, local = sliding_layers(hf_config)
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=hf_config.num_attention_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=kind == "qwen3" or gemma,
            max_position_embeddings=getattr(hf_config, "max_position_embeddings", None),
            sliding_window=window,
            local_layers=local,
            **(gemma_fields(hf_config, head_dim) if gemma else {}),
            **(hybrid_fields(hf_config) if kind in HYBRID_KINDS else {}),
        )

    def inv_freq(self, theta: float, scaling: dict | None) -> torch.Tensor:
        """RoPE inverse frequencies [head_dim/2]; a partial RoPE's padded with zeros (hybrid.py)."""
        if self.rotary_dim is None:
            return rope_inv_freq(self.head_dim, theta, scaling)
        return partial_inv_freq(rope_inv_freq(self.rotary_dim, theta, scaling), self.head_dim)

    def local_rope(self) -> tuple[float, dict | None]:
        """RoPE base and scaling of the windowed layers."""
        if self.local_rope_theta is None:
            return self.rope_theta, self.rope_scaling
        return self.local_rope_theta, self.local_rope_scaling


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


def cached_attention(q, k, v, k_cache, v_cache, positions, mask):
    """Write k, v [B,nkv,q,d] at `positions` [B,q] into the caches [B,nkv,S,d], then attend.

    q [B,nh,q,d] (nh a multiple of nkv); mask from `cache_mask`. Returns [B,nh,q,d].
    (The drafters' caches use this; the runtime model fuses the write into its RoPE kernel.)
    """
    B, nkv, n, d = k.shape
    index = positions[:, None, :, None].expand(B, nkv, n, d)
    k_cache.scatter_(2, index, k.to(k_cache.dtype))
    v_cache.scatter_(2, index, v.to(v_cache.dtype))
    return F.scaled_dot_product_attention(q, k_cache.to(q.dtype), v_cache.to(q.dtype), attn_mask=mask,
                                          enable_gqa=q.shape[1] != nkv)


def tree_verify_operands(positions, tree_mask):
    """positions [B,N+1] (the root's first), tree_mask [B,N,N] → what each layer of a tree verify
    step needs: base [B] (the root's position and slot: the root is written there, node i at
    base + 1 + i, a block the tree kernel reads straight from the cache; RoPE's `tree_block`)
    and the nodes' mask (the root is a plain cache query). No launch of their own on a GPU
    (a slot tensor and a mask with an empty root row were four, every verify step)."""
    return positions[:, 0].contiguous(), tree_mask


class Attention(nn.Module):
    def __init__(self, cfg: RuntimeConfig, window: int | None = None):
        super().__init__()
        self.window = window  # a sliding-window layer's W (keys at positions > p - W), None for global
        self.nh, self.nkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # q, k and v in one matmul: [H] → [(nh + 2 nkv) d]; loaded from q_proj/k_proj/v_proj
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.nh + 2 * self.nkv) * self.d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.nh * self.d, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x, positions, inv_freq, k_cache, v_cache, bias, causal_prefill: bool, tree=None):
        """x [B,q,H]; positions [B,q]; k_cache/v_cache [B,nkv,S,d] of this layer; bias from
        `grouped_attention_bias`, or None with causal_prefill (every row at positions 0..q-1
        of an empty cache: plain causal attention over this chunk, flash kernels, no mask).
        tree (a draft tree's verify step): `tree_verify_operands`' (base, mask), bias then its
        `tree_cache_bias` (None when the kernels run). A windowed layer's bias is built with its
        window (causal_prefill: a bool [q,q] mask, or None where the window cannot bind; a tree
        step: `tree_window_bias`, the torch form, as the tree kernel takes no window)."""
        B, n, _ = x.shape
        qkv = self.qkv_proj(x)
        if self.qk_norm:  # Qwen3 normalises each head before RoPE (in place, one launch)
            head_norm(qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.nh, self.nkv)
        if tree is not None:  # K/V written at the tree's slots, then read back from there by the tree kernel
            base, mask = tree
            q = rope_cache(qkv, positions, inv_freq, k_cache, v_cache, self.nh, self.nkv, tree_block=True)
            if self.window is not None:
                return self.o_proj(tree_attention_reference(q, k_cache, v_cache, base, None, None, mask, bias))
            return self.o_proj(tree_attention(q, k_cache, v_cache, base, None, None, mask, bias))
        q = rope_cache(qkv, positions, inv_freq, k_cache, v_cache, self.nh, self.nkv)  # [B,nh,q,d]
        if causal_prefill:
            out = F.scaled_dot_product_attention(q, k_cache[:, :, :n], v_cache[:, :, :n], attn_mask=bias,
                                                 is_causal=bias is None, enable_gqa=self.nh != self.nkv)
            out = out.transpose(1, 2).reshape(B, n, self.nh * self.d)
        elif n <= DECODE_MAX_QUERIES:
            out = decode_attention(q, k_cache, v_cache, positions, bias, window=self.window)
        else:
            out = grouped_cache_attention(q, k_cache, v_cache, bias)
        return self.o_proj(out)


class FusedMLP(nn.Module):
    """SwiGLU with gate and up in one matmul ([H] → [2I]); loaded from gate_proj/up_proj."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class GeluMLP(FusedMLP):
    """Gemma's MLP: gelu_pytorch_tanh(gate) * up, gate and up in one matmul."""

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Block(nn.Module):
    def __init__(self, cfg: RuntimeConfig, window: int | None = None):
        super().__init__()
        self.local = window is not None  # a sliding-window layer (its own RoPE base and mask)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = FusedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, residual, positions, inv_freq, k_cache, v_cache, bias, causal_prefill, tree=None,
                sum_out=None):
        """(x, residual) → (mlp output, residual): the hidden state after the layer is their
        sum, added inside the next norm (one fused kernel instead of an add and a norm).
        sum_out: where that norm writes the sum of its inputs (the previous layer's output,
        captured as an aux feature without an add of its own)."""
        normed, residual = rms_norm(x, self.input_layernorm.weight, self.input_layernorm.eps, residual, sum_out=sum_out)
        x = self.self_attn(normed, positions, inv_freq, k_cache, v_cache, bias, causal_prefill, tree)
        normed, residual = rms_norm(x, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps, residual)
        return self.mlp(normed), residual


class GemmaBlock(Block):
    """Gemma-3's layer: a norm on the attention output and norms before and after the GELU MLP
    (weights stored as 1 + w, gemma.py); the residual adds stay fused into the next norm."""

    def __init__(self, cfg: RuntimeConfig, window: int | None = None):
        super().__init__(cfg, window)
        self.mlp = GeluMLP(cfg.hidden_size, cfg.intermediate_size)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, inv_freq, k_cache, v_cache, bias, causal_prefill, tree=None,
                sum_out=None):
        normed, residual = rms_norm(x, self.input_layernorm.weight, self.input_layernorm.eps, residual, sum_out=sum_out)
        x = self.self_attn(normed, positions, inv_freq, k_cache, v_cache, bias, causal_prefill, tree)
        x, _ = rms_norm(x, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        normed, residual = rms_norm(x, self.pre_feedforward_layernorm.weight, self.pre_feedforward_layernorm.eps, residual)
        x = self.mlp(normed)
        x, _ = rms_norm(x, self.post_feedforward_layernorm.weight, self.post_feedforward_layernorm.eps)
        return x, residual


def hf_to_runtime_state(state: dict, cfg: RuntimeConfig, source: str) -> dict:
    """transformers' Llama tensor names (without `model.`) → this module's fused layout,
    strictly: a missing or unexpected tensor, or a wrong shape, is an error naming it."""
    H, d = cfg.hidden_size, cfg.head_dim
    shapes = {"embed_tokens.weight": (cfg.vocab_size, H), "norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, H), p + "mlp.up_proj.weight": (cfg.intermediate_size, H),
            p + "mlp.down_proj.weight": (H, cfg.intermediate_size),
        })
        if cfg.layer_kinds and cfg.layer_kinds[i] != "attention":
            continue  # a recurrent layer's mixer: hybrid_state checks it
        shapes.update({
            p + "self_attn.q_proj.weight": (cfg.num_heads * d, H), p + "self_attn.k_proj.weight": (cfg.num_kv_heads * d, H),
            p + "self_attn.v_proj.weight": (cfg.num_kv_heads * d, H), p + "self_attn.o_proj.weight": (H, cfg.num_heads * d),
        })
        if cfg.gemma:
            shapes.update({p + "pre_feedforward_layernorm.weight": (H,), p + "post_feedforward_layernorm.weight": (H,)})
        if cfg.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (cfg.num_heads * d,), p + "self_attn.k_proj.bias": (cfg.num_kv_heads * d,),
                           p + "self_attn.v_proj.bias": (cfg.num_kv_heads * d,)})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing = sorted(set(shapes) - set(state))
    unexpected = sorted(k for k in set(state) - set(shapes) if not k.endswith("rotary_emb.inv_freq"))
    if missing or unexpected:
        raise KeyError(f"{source}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    wrong = [f"{k} {tuple(state[k].shape)} (expected {v})" for k, v in shapes.items() if tuple(state[k].shape) != v]
    if wrong:
        raise ValueError(f"{source}: wrong shapes: {', '.join(wrong[:5])}")
    out = {k: state[k] for k in shapes}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([out.pop(p + "mlp.gate_proj.weight"), out.pop(p + "mlp.up_proj.weight")])
        if cfg.layer_kinds and cfg.layer_kinds[i] != "attention":
            continue
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            out[p + f"self_attn.qkv_proj.{kind}"] = torch.cat([out.pop(p + f"self_attn.{x}_proj.{kind}") for x in "qkv"])
    return gemma_norm_weights(out, cfg) if cfg.gemma else out


class RuntimeModel(nn.Module):
    # which kernels run and their tuning (kernels/settings.py), chosen by the caller (a CLI's
    # --kernels / --tree-attention); `generate` applies them for each generation
    kernels: KernelSettings = KernelSettings()

    def __init__(self, cfg: RuntimeConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        block = GemmaBlock if cfg.gemma else Block
        self.layers = nn.ModuleList([
            MambaBlock(cfg, FusedMLP(cfg.hidden_size, cfg.intermediate_size))
            if cfg.layer_kinds and cfg.layer_kinds[i] == "mamba" else
            block(cfg, cfg.sliding_window if i in cfg.local_layers else None) for i in range(cfg.num_layers)])
        if cfg.layer_kinds:
            self.graphable = False  # hybrid steps are not captured until checked on a GPU (hybrid.py)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", cfg.inv_freq(cfg.rope_theta, cfg.rope_scaling), persistent=False)
        # the windowed layers' RoPE frequencies (Gemma-3's local base; the same as inv_freq otherwise)
        self.register_buffer("inv_freq_local", cfg.inv_freq(*cfg.local_rope()), persistent=False)

    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype=torch.float32, device="cpu") -> "RuntimeModel":
        """Load an HF safetensors folder strictly: every tensor present with its shape, no stray ones."""
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
        mixers = {}
        if cfg.layer_kinds:
            state, mixers = hybrid_state(state, cfg, str(folder))
        state = hf_to_runtime_state(state, cfg, str(folder)) | mixers
        expected = set(model.state_dict()) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
        assert set(state) == expected, sorted(set(state) ^ expected)[:5]  # the mapping covers every tensor
        model.load_state_dict(state, strict=False, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.inv_freq = cfg.inv_freq(cfg.rope_theta, cfg.rope_scaling)  # off the meta device
        model.inv_freq_local = cfg.inv_freq(*cfg.local_rope())
        model = model.to(device=device, dtype=dtype).eval()
        # RoPE frequencies stay float32 whatever the weights' dtype: bf16-rounded frequencies
        # drift the rotation at large positions (and the kernel would cast them every layer)
        model.inv_freq = cfg.inv_freq(cfg.rope_theta, cfg.rope_scaling).to(device)
        model.inv_freq_local = cfg.inv_freq(*cfg.local_rope()).to(device)
        return model

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.embed_tokens.weight
        return (HybridCache if self.config.layer_kinds else KVCache)(self.config, batch, max_len, p.dtype, p.device)

    def forward(self, input_ids, positions, cache: KVCache, aux_layers: tuple = (), logits_at=None,
                causal_prefill: bool = False, tree_mask=None):
        """input_ids, positions [B,q] → (logits [B,q,V], aux [B,q,n*H] in aux_layers order or None).

        logits_at [B] (optional): compute the head only at this query index of each row
        (prefill needs one row of logits, not q of them); logits are then [B,1,V].
        causal_prefill: every row starts at position 0 of an empty cache (positions are
        0..q-1), so attention is plain causal over this chunk (flash kernels, no mask).

        Rows of a ragged step may carry padding tokens: they are written at positions beyond
        the row's real tokens, never attended by real queries, and overwritten later.

        tree_mask [B,N,N] (a draft tree's verify step, inference/tree/loop.py): the q = N+1
        tokens are the root, at position = slot = base, then the N nodes, node i written at slot
        base + 1 + i (fed at its own position, base + depth); every token sees the cache up to
        base, node i also the nodes of tree_mask[b, i] (its ancestors and itself).
        """
        B, q = input_ids.shape
        cfg = self.config
        if cfg.layer_kinds:  # a hybrid target: each row's recurrent state rolled back to positions[:, 0] - 1
            if tree_mask is not None:
                raise ValueError(f"a hybrid target ({', '.join(sorted(HYBRID_KINDS))}: Mamba2 layers) cannot verify "
                                 f"draft trees: the recurrent state along each path is not implemented")
            cache.begin(positions, logits_at if causal_prefill else None, prefill=causal_prefill)
        x = self.embed_tokens(input_ids)
        if cfg.gemma:
            x = x * embed_scale(cfg.hidden_size, x.dtype)
        # the additive mask of the torch attention path, built once per forward (the decode and
        # tree kernels read positions, base and the tree mask instead)
        tree = None
        if tree_mask is not None:
            tree = tree_verify_operands(positions, tree_mask)
            bias = None if use_kernel(x) else tree_cache_bias(tree[0], with_root_row(tree[1]), cache.max_len,
                                                              cfg.num_heads // cfg.num_kv_heads, x.dtype)
        else:
            bias = None if causal_prefill or (use_kernel(x) and q <= DECODE_MAX_QUERIES) else grouped_attention_bias(
                positions, cache.max_len, cfg.num_heads // cfg.num_kv_heads, x.dtype)
        local_bias = self._window_bias(positions, cache.max_len, tree, causal_prefill, x) if cfg.local_layers else None
        residual = None
        # the hidden state after aux layer i is the sum the next norm computes: that norm writes
        # it straight into its slice of the aux features [B,q,n*H] (no add, no cat)
        features = aux_layers and cfg.num_layers not in aux_layers
        aux = x.new_empty(B, q, len(aux_layers) * cfg.hidden_size) if features else None
        slices = [aux[..., j * cfg.hidden_size: (j + 1) * cfg.hidden_size] for j in range(len(aux_layers))] if features else []
        slot = {}
        for i, part in zip(aux_layers, slices):
            slot.setdefault(i, part)  # a layer listed twice: its second slice is copied at the end
        for i, layer in enumerate(self.layers):
            if layer.local:
                x, residual = layer(x, residual, positions, self.inv_freq_local, cache.k[i], cache.v[i], local_bias,
                                    causal_prefill, tree, sum_out=slot.get(i - 1))
                continue
            x, residual = layer(x, residual, positions, self.inv_freq, cache.k[i], cache.v[i], bias, causal_prefill, tree,
                                sum_out=slot.get(i - 1))
        if cfg.num_layers in aux_layers:
            # id L: the final normed hidden state, what the head reads (EAGLE-1's and Medusa's
            # input), at every position like the other aux layers
            if len(aux_layers) > 1:
                raise ValueError(f"aux layer {cfg.num_layers} (the final hidden state) cannot be mixed with other layers")
            final, _ = rms_norm(x, self.norm.weight, self.norm.eps, residual)
            if logits_at is None:
                return self._capped(self.lm_head(final)), final
            return self._capped(self.lm_head(final[torch.arange(B, device=x.device), logits_at][:, None])), final
        last = slot.get(cfg.num_layers - 1)  # an aux feature after the last layer: the final norm's sum
        if logits_at is not None:
            rows = torch.arange(B, device=x.device)
            if last is not None:
                last.copy_(x + residual)
            x, residual, last = x[rows, logits_at][:, None], residual[rows, logits_at][:, None], None
        x, _ = rms_norm(x, self.norm.weight, self.norm.eps, residual, sum_out=last)
        logits = self.lm_head(x)
        if cfg.final_logit_softcapping is not None:
            logits = self._capped(logits)
        for i, part in zip(aux_layers, slices):
            if part is not slot[i]:
                part.copy_(slot[i])
        return logits, aux

    def _capped(self, logits):
        """Final logit soft-capping (Gemma), where the config has it: tanh(logits / c) * c."""
        c = self.config.final_logit_softcapping
        return logits if c is None else torch.tanh(logits / c) * c

    def _window_bias(self, positions, max_len: int, tree, causal_prefill: bool, x):
        """The windowed layers' mask for this forward, built once (see Attention.forward): None
        where the decode kernel applies the window itself or a prefill's window cannot bind."""
        cfg = self.config
        groups, window = cfg.num_heads // cfg.num_kv_heads, cfg.sliding_window
        if tree is not None:
            return tree_window_bias(positions, with_root_row(tree[1]), max_len, groups, x.dtype, window)
        if causal_prefill:
            return prefill_window_mask(positions.shape[1], window, x.device)
        if use_kernel(x) and positions.shape[1] <= DECODE_MAX_QUERIES:
            return None
        return grouped_attention_bias(positions, max_len, groups, x.dtype, window)


class GraphedStep:
    """A CUDA graph of one fixed-shape forward (batch B, q query tokens) over a given cache.

    Decode and verify steps always have the same shapes, so their ~15 kernels per layer are
    launched by one graph replay instead of one Python call each. Inputs are copied into
    static buffers; the returned tensors are the graph's own outputs, overwritten by the next
    replay (copy what must outlive it).
    """

    def __init__(self, model: RuntimeModel, cache: KVCache, batch: int, q: int, aux_layers: tuple = ()):
        from inference.runtime.graphs import capture_graph

        dev = model.embed_tokens.weight.device
        self.cache = cache  # held: the graph writes into it (its memory must outlive the graph)
        self.ids = torch.zeros(batch, q, dtype=torch.long, device=dev)
        self.positions = torch.zeros(batch, q, dtype=torch.long, device=dev)

        def forward():
            self.logits, self.aux = model(self.ids, self.positions, cache, aux_layers)

        self.graph = capture_graph(forward, restore=(cache.k, cache.v))  # the warm-up writes into the cache

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor):
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.graph.replay()
        return self.logits, self.aux
