"""EAGLE-3 drafter: one decoder layer over [embedding; fused multi-layer target feature].

Shapes: B batch, T positions, H drafter hidden (= target hidden Ht here), V target vocab,
Vd draft vocab, n number of aux layers.

Alignment (the EAGLE convention): the target feature at position t (computed after reading
token x_t) is paired with token x_{t+1}, and the drafter predicts x_{t+2}. A draft chain
from position t feeds its own output hidden state back, with its own drafted token, at
positions t+1, t+2, ... (training-time test, TTT, unrolls exactly this).

Parameter names follow vLLM's speculators layout, so the state dict exports without
renaming (see docs/formats.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from models.draft_vocab import copy_from_target, draft_ids, register_maps
from models.target import final_norm_weight
from models.options import MethodOptions
from models.layers import DecoderAttention, DecoderShape, check_layer_ids, GatedMLP, RMSNorm, keep_rope_float32, rope_cos_sin, rope_inv_freq
from models.ttt_attention import ttt_attention


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """Low, middle and high layers as output-of-layer ids: [1, L//2 - 1, L - 4], clamped into
    range and de-duplicated for tiny targets (servers capture sorted, distinct layers)."""
    return sorted({min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4)})



@dataclass
class Eagle3Config(DecoderShape):
    target_hidden_size: int  # Ht
    aux_layer_ids: list[int]  # output-of-layer ids (hidden_states[i + 1] in transformers)
    # True: the residual around attention is the normed feature; False (EAGLE's original and
    # the only form SGLang's layout can carry): the residual is the pre-norm feature.
    norm_before_residual: bool = False
    # RMSNorm over the concatenated aux features before fc (speculators `input_norm`).
    norm_before_fc: bool = False
    # EAGLE-3.1: one RMSNorm per aux feature [Ht] before fc (speculators/vLLM `fc_norm.{i}`),
    # applied after input_norm when both are on, as vLLM 0.33 does
    fc_norm: bool = False
    # EAGLE-3.1: a chain step feeds the next one the final-normed hidden state (the head's
    # input) instead of the layer's pre-norm output
    norm_output: bool = False

    def __post_init__(self):
        check_layer_ids(self.aux_layer_ids, self.target_num_layers)
        super().__post_init__()
        if self.hidden_size != self.target_hidden_size:
            raise ValueError("EAGLE-3 here shares the target's embedding and head rows, so hidden_size must equal the target's")

    @classmethod
    def from_target(cls, hf_config, draft_vocab_size: int, aux_layer_ids: list[int] | None = None, **options) -> "Eagle3Config":
        ids = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(hf_config.num_hidden_layers)
        return super().from_target(hf_config, draft_vocab_size, target_hidden_size=hf_config.hidden_size, aux_layer_ids=ids,
                                   **options)


@dataclass
class Eagle3Options(MethodOptions):
    """The run config's `drafter.eagle3` section."""

    norm_before_residual: bool = False
    """Residual around the drafter's attention is the normed feature (true) or pre-norm (false,
    EAGLE's original and the only form SGLang's layout carries)."""
    norm_before_fc: bool = False
    """RMSNorm over the concatenated aux features before fc (speculators' `input_norm`)."""
    fc_norm: bool = False
    """EAGLE-3.1: one RMSNorm per aux layer's feature before fc (speculators' `fc_norm`), in
    place of norm_before_fc's one norm over the concatenation (speculators refuses both)."""
    norm_output: bool = False
    """EAGLE-3.1: each draft step feeds the next one its hidden state after the final norm
    (speculators' `norm_output`), not before it."""

    RENAMED: ClassVar[dict] = {"norm_before_residual": "norm_before_residual", "norm_before_fc": "norm_before_fc"}

    def problems(self, run, key: str) -> list[str]:
        if self.fc_norm and self.norm_before_fc:  # speculators 0.9 models/eagle3/config.py:89-96
            return [f"{key}.fc_norm: one norm per aux layer replaces norm_before_fc's norm over their concatenation; "
                    f"set {key}.norm_before_fc=false (speculators 0.9 refuses a config with both)"]
        return []


def build(d, hf_config, vd: int, mask_token_id: int) -> "Eagle3Drafter":
    """The drafter of run-config drafter section `d` (its `options`: Eagle3Options) for this target."""
    return Eagle3Drafter(Eagle3Config.from_target(hf_config, vd, d.aux_layer_ids,
                                                  norm_before_residual=d.options.norm_before_residual,
                                                  norm_before_fc=d.options.norm_before_fc,
                                                  fc_norm=d.options.fc_norm, norm_output=d.options.norm_output))


def ttt_attend(kv_steps: list):
    """Attention of one TTT step: step-0 keys causally, later steps' keys at the same index."""
    def attend(q, k, v):
        kv_steps.append((k, v))
        return ttt_attention(q, [kk for kk, _ in kv_steps], [vv for _, vv in kv_steps])
    return attend


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DecoderAttention(cfg, 2 * cfg.hidden_size)  # over [embedding; feature]
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, embeds, hidden, cos, sin, attend):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # embedding first
        h = residual + self.self_attn(x, cos, sin, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t] <- x[:, t + n], padding the end with `fill`."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


class Eagle3Drafter(nn.Module):
    _apply = keep_rope_float32  # inv_freq stays float32 through .to(bfloat16), as in training

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        n_aux = len(cfg.aux_layer_ids)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # frozen copy of the target's
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(n_aux * cfg.target_hidden_size, cfg.rms_norm_eps)
        if cfg.fc_norm:  # one per aux feature, in aux order (the chunks of the concatenation)
            self.fc_norm = nn.ModuleList([RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(n_aux)])
        self.fc = nn.Linear(n_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(cfg)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        register_maps(self, cfg)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), persistent=False)

    # ------------------------------------------------------------------ initialisation
    @torch.no_grad()
    def init_from_target(self, target_model, d2t: torch.Tensor, t2d: torch.Tensor):
        """Embedding (frozen) and head rows from the target; draft vocab maps installed."""
        copy_from_target(self, target_model, d2t, t2d)
        self.norm.weight.copy_(final_norm_weight(target_model))  # Gemma's: 1 + w

    def draft_ids(self) -> torch.Tensor:
        """[Vd] target id of each draft-vocab row."""
        return draft_ids(self.d2t)

    # ------------------------------------------------------------------ drafter interface
    @property
    def aux_layer_ids(self) -> list[int]:
        return self.config.aux_layer_ids

    def features(self, target_out) -> torch.Tensor:
        """What the drafter reads from a target pass: the aux layers concatenated [B,T,n*Ht]."""
        return target_out.aux

    def train_steps(self, requested: int) -> int:
        return requested  # the TTT unroll length

    # ------------------------------------------------------------------ forward pieces
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B,T,n*Ht] (low, mid, high concatenated) → fused feature [B,T,H]."""
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        if self.config.fc_norm:  # [B,T,n*Ht] as n chunks [B,T,Ht], each normed by its own weight
            aux = torch.cat([norm(x) for norm, x in zip(self.fc_norm, aux.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(aux)

    def fed_back(self, hidden: torch.Tensor) -> torch.Tensor:
        """What a draft step's output hidden [B,T,H] feeds the next step: itself, or (EAGLE-3.1
        norm_output) the final norm of it, the head's very input."""
        return self.norm(hidden) if self.config.norm_output else hidden

    def step(self, tokens, hidden, positions, attend):
        """One draft step. tokens [B,T], hidden [B,T,H], positions [B,T] → new hidden [B,T,H]."""
        cos, sin = rope_cos_sin(self.inv_freq, positions, hidden.dtype)
        return self.layers[0](self.embed_tokens(tokens).to(hidden.dtype), hidden, cos, sin, attend)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B,T,H] → [B,T,Vd] over the draft vocabulary."""
        return self.lm_head(self.norm(hidden))

    def unroll(self, input_ids, aux, steps: int, position_ids=None, greedy: bool = False, pick=None):
        """Training-time test: `steps` chained draft steps at every position at once.

        Step s at index t drafts token t+2+s. Its input token is x_{t+1+s} (teacher forcing,
        training) or the step s-1 draft at t (greedy: exactly the chain a runtime drafts).
        Each later step is fed the last one's `fed_back` hidden state.
        Returns a list of `steps` logits tensors [B,T,Vd].
        """
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        hidden = self.fuse(aux)
        attend = ttt_attend([])
        out = []
        tokens = shift_left(input_ids, 1)
        for s in range(steps):
            if s > 0:
                # pick: the caller chooses the fed tokens (sampled chains, inference/walks/sampled.py)
                tokens = pick(out[-1]) if pick is not None else \
                    self.draft_ids()[out[-1].argmax(-1)] if greedy else shift_left(input_ids, 1 + s)
                hidden = self.fed_back(hidden)
            hidden = self.step(tokens, hidden, position_ids + s, attend)
            out.append(self.logits(hidden))
        return out
