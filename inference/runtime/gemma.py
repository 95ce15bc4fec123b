"""Gemma-3's parts of the runtime model, and the sliding-window masks of any windowed target.

Gemma-3 (transformers' `gemma3_text`, modeling_gemma3.py) differs from Llama in:
  - RMSNorm weight (1 + w), the product taken in float32: the loaded weights are stored as
    1 + w, so the runtime's norm kernels serve it unchanged (in float32 the very same numbers;
    in 16-bit the normalised value is rounded once more before the weight multiplies it);
  - norms around attention and around the MLP ("sandwich": post_attention_layernorm on the
    attention output, pre_/post_feedforward_layernorm around the MLP);
  - per-head query/key norms (as Qwen3, with the 1 + w weights), the query scale
    query_pre_attn_scalar ** -0.5 (folded into the query norm's weight: RoPE is linear);
  - a GELU (tanh) MLP, embeddings scaled by sqrt(hidden) rounded to the weights' dtype;
  - local layers (layer_types "sliding_attention") that see the last `sliding_window` positions
    and have their own RoPE base; global layers see everything;
  - optional final logit soft-capping (tanh(logits / c) * c). transformers 5.25's Gemma-3
    attention never passes attn_logit_softcapping to its attention functions, so the runtime
    does not cap attention scores either (equal logits are the contract).
Mistral configs and Qwen configs with use_sliding_window get the same windows (their layer_types
or every layer), with the model's one RoPE base.
"""
from __future__ import annotations

import functools

import torch

from draftsmith_kernels.tree_attention import tree_cache_bias

GEMMA_KINDS = {"gemma3_text"}


def layer_rope(hf_config, layer_type: str) -> tuple[float, dict | None]:
    """(theta, scaling) of one layer type from Gemma-3's per-type rope_parameters."""
    params = (getattr(hf_config, "rope_parameters", None) or {}).get(layer_type)
    if not params or "rope_theta" not in params:
        raise ValueError(f"gemma3_text config has no rope_parameters[{layer_type!r}] with a rope_theta")
    kind = params.get("rope_type", "default")
    return float(params["rope_theta"]), (None if kind == "default" else dict(params))


def sliding_layers(hf_config) -> tuple[int | None, tuple[int, ...]]:
    """(window, indices of the windowed layers); (None, ()) when no layer has a window.

    transformers' layer_types names each layer's kind (Gemma-3, Qwen2/3 with
    use_sliding_window); a config with a sliding_window and no layer_types (Mistral) windows
    every layer, as its masks do."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return None, ()
    types = getattr(hf_config, "layer_types", None)
    if types is None:
        local = tuple(range(hf_config.num_hidden_layers))
    else:
        local = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return (int(window), local) if local else (None, ())


def gemma_fields(hf_config, head_dim: int) -> dict:
    """RuntimeConfig fields of a gemma3_text config (refusing what the runtime does not compute)."""
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError("gemma3_text with use_bidirectional_attention is not a causal LM")
    act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", None)
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"gemma3_text with hidden_activation {act!r} (the runtime has gelu_pytorch_tanh)")
    local_theta, local_scaling = layer_rope(hf_config, "sliding_attention")
    scalar = getattr(hf_config, "query_pre_attn_scalar", None)
    return dict(
        gemma=True, local_rope_theta=local_theta, local_rope_scaling=local_scaling,
        query_scale=None if scalar is None or scalar == head_dim else float(scalar) ** -0.5,
        final_logit_softcapping=getattr(hf_config, "final_logit_softcapping", None),
    )


def gemma_norm_weights(state: dict, cfg) -> dict:
    """In place: every norm weight w → 1 + w (computed in float32, stored in w's dtype); the query
    norm's also times query_scale / head_dim ** -0.5 (the attention kernels scale by head_dim)."""
    ratio = cfg.query_scale / cfg.head_dim ** -0.5 if cfg.query_scale is not None else 1.0
    for name, w in state.items():
        if name.endswith("norm.weight"):
            one = 1.0 + w.float()
            state[name] = (one * ratio if name.endswith("q_norm.weight") else one).to(w.dtype)
    return state


@functools.cache
def embed_scale(hidden: int, dtype: torch.dtype) -> float:
    """sqrt(hidden) rounded to the embeddings' dtype, as transformers multiplies them."""
    return float(torch.tensor(hidden ** 0.5).to(dtype))


def prefill_window_mask(n: int, window: int, device) -> torch.Tensor | None:
    """[n,n] bool of a prefill from position 0 (causal and within the window), or None when the
    window cannot bind inside n tokens (plain causal attention then)."""
    if n <= window:
        return None
    i = torch.arange(n, device=device)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)


def tree_window_bias(positions, node_mask, max_len: int, groups: int, dtype, window: int) -> torch.Tensor:
    """A tree verify step's [B,1,groups*(N+1),S] additive mask for a windowed layer: the tree's
    own (tree_cache_bias over the root row and node_mask [B,N+1,N]) with every key at a position
    <= the query's position - window hidden. positions [B,N+1]: the root's (its slot too), then
    each node's; the cache slots up to the root hold their own positions, node j sits at slot
    root + 1 + j."""
    B, M = positions.shape
    base = positions[:, 0]
    bias = tree_cache_bias(base, node_mask, max_len, groups, dtype)
    slot_pos = torch.arange(max_len, device=positions.device).expand(B, max_len).clone()
    slots = (base[:, None] + 1 + torch.arange(M - 1, device=positions.device)).clamp_(max=max_len - 1)
    slot_pos.scatter_(1, slots, positions[:, 1:])
    far = slot_pos[:, None, :] <= positions[:, :, None] - window  # [B,M,S]
    return bias.masked_fill(far[:, None].repeat(1, 1, groups, 1), float("-inf"))
