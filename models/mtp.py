"""MTP drafter (DeepSeek-V3 form): D sequential modules; module d combines the embedding of
token x_{t+d} with the previous module's hidden state at t and predicts x_{t+d+1}.

Shapes: B batch, T positions, H hidden (the target's), Vd draft vocab, D modules.

Module d (1-based): h^d_t = Layer_d(eh_proj_d([enorm_d(embed(x_{t+d})); hnorm_d(h^{d-1}_t)]))
(embedding first, as vLLM loads it), logits = head(shared_head_norm_d(h^d_t)); h^0 is the
target's final normed hidden state. Embedding and head are the target's, frozen.

Alignment (shared with every drafter here): step s = d-1 at index t predicts x_{t+2+s}.
Training is teacher-forced: module d reads the real x_{t+d} and attends causally over its own
entries. Drafting a chain from the last verified position t (the bonus x_{t+1} known) reads
the previous module's draft instead of x_{t+d}; module d then attends to its teacher-forced
entries at positions t' <= t + 1 - d (those need x_{t'+d}, verified only that far; a runtime
fills them as tokens are verified) and to its own drafted entry at t. `unroll(greedy=True)`
computes exactly that, for every t at once, and is what predicted acceptance measures.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from models.draft_vocab import copy_from_target, draft_ids, register_maps
from models.target import final_norm_weight
from models.eagle3 import shift_left
from models.options import MethodOptions, positive_int
from models.layers import DecoderAttention, DecoderShape, GatedMLP, RMSNorm, keep_rope_float32, rope_cos_sin, rope_inv_freq


@dataclass
class MTPConfig(DecoderShape):
    num_modules: int = 3  # D

    def __post_init__(self):
        if self.num_modules < 1:
            raise ValueError(f"MTP needs at least one module, got {self.num_modules}")
        super().__post_init__()

    @classmethod
    def from_target(cls, hf_config, draft_vocab_size: int, num_modules: int = 3) -> "MTPConfig":
        return super().from_target(hf_config, draft_vocab_size, num_modules=num_modules)


@dataclass
class MTPOptions(MethodOptions):
    """The run config's `drafter.mtp` section."""

    modules: int = 3
    """D sequential modules; module d predicts the token d+1 positions after the last verified one."""

    RANGES: ClassVar[tuple] = (("modules", positive_int, "a positive integer"),)
    RENAMED: ClassVar[dict] = {"mtp_modules": "modules"}

    def problems(self, run, key: str) -> list[str]:
        if run.eval.k > self.modules:
            return [f"eval.k: {run.eval.k} drafts need {run.eval.k} MTP modules; {key}.modules is {self.modules}"]
        return []


def build(d, hf_config, vd: int, mask_token_id: int) -> "MTPDrafter":
    """The drafter of run-config drafter section `d` (its `options`: MTPOptions) for this target."""
    return MTPDrafter(MTPConfig.from_target(hf_config, vd, d.options.modules))


def stream_attend(kv: list, context=None, lag: int = 1):
    """Attention of one module's stream; appends the stream's own (k, v) [B,nh,T,d] to `kv`
    (the greedy stream reads the teacher-forced one's). context None: causal over the stream's
    own keys. context (k, v) of the teacher-forced stream: query t sees those keys at
    positions <= t - lag and its own key at t."""
    def attend(q, k, v):
        kv.append((k, v))
        if context is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        T, dev = q.shape[2], q.device
        before = torch.ones(T, T, dtype=torch.bool, device=dev).tril(-lag)
        mask = torch.cat([before, torch.eye(T, dtype=torch.bool, device=dev)], dim=1)  # [T, 2T]
        return F.scaled_dot_product_attention(q, torch.cat([context[0], k], 2), torch.cat([context[1], v], 2), attn_mask=mask)
    return attend


class MTPModule(nn.Module):
    def __init__(self, cfg: MTPConfig):
        super().__init__()
        H = cfg.hidden_size
        self.enorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(H, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = DecoderAttention(cfg)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = GatedMLP(H, cfg.intermediate_size)
        self.shared_head_norm = RMSNorm(H, cfg.rms_norm_eps)

    def forward(self, embeds, hidden, cos, sin, context=None, lag: int = 1):
        """embeds, hidden [B,T,H] → (h^d [B,T,H], (k, v) of this stream)."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))  # embedding first
        kv = []
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, stream_attend(kv, context, lag))
        return h + self.mlp(self.post_attention_layernorm(h)), kv[0]


class MTPDrafter(nn.Module):
    aux_layer_ids: list[int] = []  # reads the target's final hidden state only

    _apply = keep_rope_float32  # inv_freq stays float32 through .to(bfloat16), as in training

    def __init__(self, cfg: MTPConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.mtp = nn.ModuleList([MTPModule(cfg) for _ in range(cfg.num_modules)])
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)  # the target's head rows, shared by every module
        register_maps(self, cfg)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), persistent=False)

    @torch.no_grad()
    def init_from_target(self, target_model, d2t: torch.Tensor, t2d: torch.Tensor):
        """Embedding and head from the target; each module's decoder layer from the target's
        last layer and its head norm from the target's final norm (a warm start)."""
        copy_from_target(self, target_model, d2t, t2d)
        last = target_model.model.layers[-1]
        for module in self.mtp:
            module.shared_head_norm.weight.copy_(final_norm_weight(target_model))  # Gemma's: 1 + w
            for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
                getattr(module, name).load_state_dict(getattr(last, name).state_dict())
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(module.self_attn, name).load_state_dict(getattr(last.self_attn, name).state_dict())

    def draft_ids(self) -> torch.Tensor:
        return draft_ids(self.d2t)

    def features(self, target_out) -> torch.Tensor:
        return target_out.last_hidden

    def train_steps(self, requested: int) -> int:
        return self.config.num_modules  # every module is trained

    def logits(self, module: MTPModule, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(module.shared_head_norm(hidden))

    def unroll(self, input_ids, features, steps: int, position_ids=None, greedy: bool = False, pick=None):
        """Modules 1..steps at every position: a list of logits [B,T,Vd]; step s at index t
        predicts x_{t+2+s}. greedy: each module reads the previous module's draft (module 1
        reads x_{t+1}, the verified bonus) and sees the teacher-forced entries before t."""
        if steps > self.config.num_modules:
            raise ValueError(f"a chain of {steps} drafts needs {steps} MTP modules; this drafter has {self.config.num_modules}")
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        dtype = self.eh_dtype()
        cos, sin = rope_cos_sin(self.inv_freq, position_ids, dtype)
        h_tf = h_dr = features.to(dtype)
        out, draft = [], None
        for s in range(steps):
            module = self.mtp[s]
            real = shift_left(input_ids, 1 + s)  # x_{t+1+s}
            h_tf, kv_tf = module(self.embed_tokens(real).to(dtype), h_tf, cos, sin)
            if not greedy:
                out.append(self.logits(module, h_tf))
                continue
            if s == 0:  # module 1 reads the verified bonus x_{t+1}: the teacher-forced pass itself
                h_dr = h_tf
            else:  # its entry at t' needs x_{t'+s+1}, known (<= x_{t+1}) only for t' <= t - s
                h_dr, _ = module(self.embed_tokens(draft).to(dtype), h_dr, cos, sin, context=kv_tf, lag=s)
            logits = self.logits(module, h_dr)
            if pick is None:
                draft = self.draft_ids()[logits.argmax(-1)]
            elif s + 1 < steps:  # the caller chooses the fed tokens (sampled chains, inference/walks/sampled.py)
                draft = pick(logits)
            out.append(logits)
        return out

    def eh_dtype(self):
        return self.mtp[0].eh_proj.weight.dtype
