"""EAGLE-1 drafter: one decoder layer over fc([embedding; top feature]) that regresses the
target's next feature; the target's own head turns a feature into tokens.

Shapes: B batch, T positions, H hidden (the target's), Vd draft vocab.

Alignment (shared with EAGLE-3): the target's feature f_t (its final normed hidden state,
what its head reads to produce x_{t+1}) is paired with token x_{t+1}; the drafter outputs
f̂, an estimate of f_{t+1}, and head(f̂) predicts x_{t+2}. A chain feeds f̂ back with its own
drafted token at t+1, t+2, ...; training unrolls the same way (`objective.ttt_steps`; EAGLE-1's
original training is the single teacher-forced step, ttt_steps = 1).

Layout as docs/formats.md describes the EAGLE-1 checkpoint: `fc` Linear(2H -> H) with bias (without
when `fc_bias` is false, the form vLLM's `eagle` method computes), one
decoder layer without an input norm, no final norm, the target's head (frozen here, restricted
to the draft vocabulary; Vd = V serves the layout as is).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from models.draft_vocab import copy_from_target, draft_ids, register_maps
from models.eagle3 import shift_left, ttt_attend
from models.options import MethodOptions
from models.layers import DecoderAttention, DecoderShape, GatedMLP, RMSNorm, keep_rope_float32, rope_cos_sin, rope_inv_freq


@dataclass
class Eagle1Config(DecoderShape):
    # fc with a bias (SGLang's and the EAGLE reference's EAGLE-1); vLLM's `eagle` fc has none
    fc_bias: bool = True


@dataclass
class Eagle1Options(MethodOptions):
    """The run config's `drafter.eagle1` section."""

    fc_bias: bool = True
    """fc has a bias (the SGLang / EAGLE layout); false to serve it in vLLM (`--format eagle-vllm`)."""

    RENAMED: ClassVar[dict] = {"fc_bias": "fc_bias"}


def build(d, hf_config, vd: int, mask_token_id: int) -> "Eagle1Drafter":
    """The drafter of run-config drafter section `d` (its `options`: Eagle1Options) for this target."""
    return Eagle1Drafter(Eagle1Config.from_target(hf_config, vd, fc_bias=d.options.fc_bias))


class Eagle1Layer(nn.Module):
    """A Llama decoder layer without the input norm (EAGLE-1 feeds fc's output straight in)."""

    def __init__(self, cfg: Eagle1Config):
        super().__init__()
        self.self_attn = DecoderAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, attend):
        h = x + self.self_attn(x, cos, sin, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle1Drafter(nn.Module):
    aux_layer_ids: list[int] = []  # reads the target's final hidden state only

    _apply = keep_rope_float32  # inv_freq stays float32 through .to(bfloat16), as in training

    def __init__(self, cfg: Eagle1Config):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # frozen copy of the target's
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.layers = nn.ModuleList([Eagle1Layer(cfg)])
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)  # the target's head rows, frozen
        register_maps(self, cfg)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), persistent=False)

    @torch.no_grad()
    def init_from_target(self, target_model, d2t: torch.Tensor, t2d: torch.Tensor):
        copy_from_target(self, target_model, d2t, t2d)

    def draft_ids(self) -> torch.Tensor:
        return draft_ids(self.d2t)

    def features(self, target_out) -> torch.Tensor:
        """The target's final normed hidden state [B,T,H] (its head's input)."""
        return target_out.last_hidden

    def feature_targets(self, target_out) -> torch.Tensor:
        """What a draft step's output regresses to: f_{t+1+s} at step s, index t."""
        return target_out.last_hidden

    def train_steps(self, requested: int) -> int:
        return requested

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The runtime's entry point (shared with EAGLE-3): EAGLE-1 reads the feature as is."""
        return features.to(self.fc.weight.dtype)

    def step(self, tokens, feature, positions, attend):
        """tokens [B,T], feature [B,T,H] → predicted next feature [B,T,H]."""
        cos, sin = rope_cos_sin(self.inv_freq, positions, feature.dtype)
        x = self.fc(torch.cat([self.embed_tokens(tokens).to(feature.dtype), feature], dim=-1))  # embedding first
        return self.layers[0](x, cos, sin, attend)

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        return self.lm_head(feature)

    def unroll(self, input_ids, features, steps: int, position_ids=None, greedy: bool = False, with_features: bool = False,
               pick=None):
        """`steps` chained draft steps at every position (as EAGLE-3's TTT): step s at index t
        reads token x_{t+1+s} (or the step s-1 draft, greedy) and its previous feature, and
        drafts x_{t+2+s}. Returns logits [B,T,Vd] per step (and the predicted features)."""
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        feature = features.to(self.fc.weight.dtype)
        attend = ttt_attend([])
        logits, predicted = [], []
        tokens = shift_left(input_ids, 1)
        for s in range(steps):
            if s > 0:
                # pick: the caller chooses the fed tokens (sampled chains, inference/walks/sampled.py)
                tokens = pick(logits[-1]) if pick is not None else \
                    self.draft_ids()[logits[-1].argmax(-1)] if greedy else shift_left(input_ids, 1 + s)
            feature = self.step(tokens, feature, position_ids + s, attend)
            predicted.append(feature)
            logits.append(self.logits(feature))
        return (logits, predicted) if with_features else logits
