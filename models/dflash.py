"""DFlash drafter: a few decoder layers that draft a whole block in one forward, with the
target's fused multi-layer features injected into the keys and values of every layer.

Shapes: T context positions, m blocks (anchors), B block size, H hidden (the target's),
n target layers fused, Vd draft vocab.

Alignment (shared with every drafter here): a block anchored at index a continues the
verified text x_0..x_{a+1}: its tokens are [x_{a+1}, MASK x (B-1)] at positions a+1..a+B,
block position j >= 1 predicts x_{a+1+j} (draft j; draft 1 is x_{a+2}), and its context is
the target's features at positions <= a (those exist once x_{a+1} is verified).

Each layer: queries from the block's hidden states; keys and values projected from
[context feature; block hidden states] (k_norm and RoPE on all keys), so the context enters
every layer undiluted. Attention is bidirectional inside a block and sees the context up to
its anchor; blocks never see each other. Embedding and head are the target's, frozen; the
mask token is a real row of the target's embedding. Parameter names follow the z-lab layout
(docs/formats.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from models.draft_vocab import copy_from_target, draft_ids, register_maps
from models.target import final_norm_weight
from models.options import MethodOptions, int_in, non_negative_int, optional, positive_int
from models.layers import DecoderAttention, DecoderShape, check_layer_ids, GatedMLP, RMSNorm, apply_rope, keep_rope_float32, rope_cos_sin, rope_inv_freq

GAMMA_BY_BLOCK = {16: 7.0, 10: 5.0, 8: 4.0}  # position-weight decay the reference trainers use


def default_target_layer_ids(num_layers: int, n: int = 5) -> list[int]:
    """Evenly spaced output-of-layer ids round(1 + i (L-4)/(n-1)), clamped and de-duplicated for
    tiny targets (servers capture sorted, distinct layers)."""
    if n == 1:
        return [min(1, num_layers - 1)]
    return sorted({min(max(round(1 + i * (num_layers - 4) / (n - 1)), 0), num_layers - 1) for i in range(n)})


@dataclass
class DFlashConfig(DecoderShape):
    mask_token_id: int
    target_layer_ids: list[int] = field(default_factory=list)  # n ids; empty: default_target_layer_ids
    num_layers: int = 5
    block_size: int = 8  # B

    def __post_init__(self):
        if not 2 <= self.block_size <= 16:
            raise ValueError(f"block_size {self.block_size} must be in 2..16")
        if not self.target_layer_ids:
            self.target_layer_ids = default_target_layer_ids(self.target_num_layers)
        check_layer_ids(self.target_layer_ids, self.target_num_layers, "target layer id")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is not a row of the target's embedding (0..{self.vocab_size - 1})")
        super().__post_init__()

    @property
    def gamma(self) -> float:
        return GAMMA_BY_BLOCK.get(self.block_size, 4.0 + 3.0 * (self.block_size - 8) / 8)

    @classmethod
    def from_target(cls, hf_config, draft_vocab_size: int, mask_token_id: int, num_layers: int = 5, block_size: int = 8,
                    target_layer_ids: list[int] | None = None) -> "DFlashConfig":
        return super().from_target(hf_config, draft_vocab_size, mask_token_id=mask_token_id,
                                   target_layer_ids=list(target_layer_ids or []), num_layers=num_layers, block_size=block_size)


@dataclass
class DFlashOptions(MethodOptions):
    """The run config's `drafter.dflash` section."""

    block_size: int = 8
    """Block size B (2..16); one forward drafts B-1 tokens."""
    layers: int = 5
    """Decoder layers of the drafter."""
    mask_token_id: int | None = None
    """The mask token (a real row of the target's embedding); default a special token chat text never uses."""
    target_layers: int = 5
    """Target layers fused into the context feature (evenly spaced), unless drafter.aux_layer_ids names them."""

    RANGES: ClassVar[tuple] = (("block_size", int_in(2, 16), "an integer in 2..16"),
                               ("layers", positive_int, "a positive integer"),
                               ("mask_token_id", optional(non_negative_int), "a token id (>= 0) or null"),
                               ("target_layers", positive_int, "a positive integer"))
    RENAMED: ClassVar[dict] = {"dflash_block_size": "block_size", "dflash_layers": "layers",
                               "dflash_mask_token_id": "mask_token_id", "dflash_target_layers": "target_layers"}

    def problems(self, run, key: str) -> list[str]:
        if run.eval.k > self.block_size - 1:
            return [f"eval.k: a block of {self.block_size} ({key}.block_size) drafts {self.block_size - 1} tokens, "
                    f"not {run.eval.k}"]
        return []


def build(d, hf_config, vd: int, mask_token_id: int) -> "DFlashDrafter":
    """The drafter of run-config drafter section `d` (its `options`: DFlashOptions) for this target;
    `mask_token_id`: the default mask (a special token chat text never uses), unless the
    section names one."""
    o = d.options
    layer_ids = d.aux_layer_ids or default_target_layer_ids(hf_config.num_hidden_layers, o.target_layers)
    mask = o.mask_token_id if o.mask_token_id is not None else mask_token_id
    return DFlashDrafter(DFlashConfig.from_target(hf_config, vd, mask, o.layers, o.block_size, layer_ids))


class DFlashAttention(DecoderAttention):
    """The decoder attention's projections plus per-head q/k norms; keys and values also come
    from the context, so its own forward."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__(cfg)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)

    def forward(self, x, context, rope_q, rope_k, mask):
        """x [R,Q,H] block hidden states of R rows; context [R,T,H]; rope_q / rope_k: (cos, sin)
        for the Q block positions and the T+Q key positions; mask [R,1,Q,T+Q] bool."""
        R, Q, _ = x.shape
        kv_in = torch.cat([context, x], dim=1)  # context keys first, then the blocks'
        q = self.q_norm(self.q_proj(x).view(R, Q, self.nh, self.d)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(R, -1, self.nkv, self.d)).transpose(1, 2)
        v = self.v_proj(kv_in).view(R, -1, self.nkv, self.d).transpose(1, 2)
        q, k = apply_rope(q, *rope_q), apply_rope(k, *rope_k)
        if self.nkv != self.nh:
            k = k.repeat_interleave(self.nh // self.nkv, dim=1)
            v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(R, Q, self.nh * self.d))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h, context, rope_q, rope_k, mask):
        h = h + self.self_attn(self.input_layernorm(h), context, rope_q, rope_k, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    _apply = keep_rope_float32  # inv_freq stays float32 through .to(bfloat16), as in training

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)
        register_maps(self, cfg)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), persistent=False)

    # ------------------------------------------------------------------ drafter interface
    @property
    def aux_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    @torch.no_grad()
    def init_from_target(self, target_model, d2t: torch.Tensor, t2d: torch.Tensor):
        """Embedding and head (frozen) from the target; the final norm from its final norm."""
        copy_from_target(self, target_model, d2t, t2d)
        self.norm.weight.copy_(final_norm_weight(target_model))  # Gemma's: 1 + w

    def draft_ids(self) -> torch.Tensor:
        return draft_ids(self.d2t)

    def features(self, target_out) -> torch.Tensor:
        return target_out.aux  # [B,T,n*H]

    def train_steps(self, requested: int) -> int:
        return self.config.block_size - 1

    def position_weights(self) -> list[float]:
        """exp(-(j-1)/gamma) for block positions j = 1..B-1."""
        return [math.exp(-j / self.config.gamma) for j in range(self.config.block_size - 1)]

    # ------------------------------------------------------------------ forward
    def block_logits(self, ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """m blocks per sequence in one forward. ids [T], features [T,n*H], anchors [m] (block i
        continues x_0..x_{a_i+1}; requires a_i + 1 < T) → logits [m, B, Vd]; or R sequences at
        once: ids [R,T], features [R,T,n*H], anchors [R,m] → [R, m, B, Vd] (training batches
        its rows in one forward; each row's blocks see only that row)."""
        return self.lm_head(self.block_hidden(ids, features, anchors))

    def block_hidden(self, ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """The backbone of `block_logits`: the final-normed hidden states the head reads,
        [m, B, H] (or [R, m, B, H] for R rows), shapes as there. DSpark's heads read them too."""
        if ids.dim() == 1:
            return self.block_hidden(ids[None], features[None], anchors[None])[0]
        cfg = self.config
        B, (R, m), T = cfg.block_size, anchors.shape, ids.shape[1]
        dev = ids.device
        dtype = self.fc.weight.dtype
        context = self.hidden_norm(self.fc(features.to(dtype)))  # [R,T,H]
        block = torch.full((R, m, B), cfg.mask_token_id, dtype=torch.long, device=dev)
        block[:, :, 0] = ids.gather(1, anchors + 1)
        h = self.embed_tokens(block).to(dtype).view(R, m * B, -1)
        block_pos = (anchors[:, :, None] + 1 + torch.arange(B, device=dev)).view(R, m * B)
        key_pos = torch.cat([torch.arange(T, device=dev).expand(R, T), block_pos], 1)
        rope_q = rope_cos_sin(self.inv_freq, block_pos, dtype)
        rope_k = rope_cos_sin(self.inv_freq, key_pos, dtype)
        owner = torch.arange(m, device=dev).repeat_interleave(B)  # block of each query / block key
        sees_context = torch.arange(T, device=dev)[None, None, :] <= anchors[:, owner][:, :, None]  # [R, m*B, T]
        same_block = (owner[:, None] == owner[None, :]).expand(R, -1, -1)  # [R, m*B, m*B]
        mask = torch.cat([sees_context, same_block], dim=2)[:, None]  # [R, 1, m*B, T + m*B]
        for layer in self.layers:
            h = layer(h, context, rope_q, rope_k, mask)
        return self.norm(h).view(R, m, B, -1)

    def draft_at(self, ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor, k: int) -> torch.Tensor:
        """Greedy drafts of the blocks at these anchors: [m, k] target ids (k <= B-1)."""
        if k > self.config.block_size - 1:
            raise ValueError(f"a block of {self.config.block_size} drafts at most {self.config.block_size - 1} tokens, not {k}")
        logits = self.block_logits(ids, features, anchors)[:, 1 : k + 1]
        return self.draft_ids()[logits.argmax(-1)]

    def drive_block(self, ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor, k: int, step) -> None:
        """The sampled walk's drafting (inference.walks.sampled.drive_drafter): step(logits [m,Vd])
        → tokens [m] for drafts 1..k of the blocks at anchors [m] in order. DFlash's drafts read
        no drafted token, so the tokens step returns are not fed back (DSpark's are)."""
        logits = self.block_logits(ids, features, anchors)[:, 1 : k + 1]  # [m,k,Vd]
        for s in range(k):
            step(logits[:, s])
