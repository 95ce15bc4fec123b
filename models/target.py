"""The target model wrapper used in training.

Returns the hidden states of chosen layers (layer id i = output of decoder layer i, which is
`hidden_states[i + 1]` of transformers' `output_hidden_states` for i < L-1; for i = L-1 we
return the pre-norm output, transformers returns it normed), the final normed hidden state,
and, chunk-wise from the target's own head, teacher probabilities over the draft vocabulary
and the greedy token over the full vocabulary. No [B, T, V] float32 tensor is ever built.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class TargetOutput:
    aux: torch.Tensor  # [B, T, n*Ht]: aux layers concatenated, in the order asked
    last_hidden: torch.Tensor  # [B, T, Ht]: after the final norm


# The training pass attends causally over a whole right-padded batch (padding only follows real
# tokens, and its positions are out of every loss). Through transformers' "sdpa" the decoder first
# prepares a mask, and with no mask and no cache that means a packed-sequence check that reads a
# device value: a host sync at every training step, which keeps the host from queueing the next
# step while the device finishes this one. This implementation needs no mask (transformers skips
# mask preparation for attention it has no mask function for) and makes sdpa's own causal call.
CAUSAL_ATTENTION = "draftsmith_causal"


def causal_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """q [B,h,T,d], k / v [B,kv,T,d] → ([B,T,h,d], None), as transformers' attention functions."""
    # what this does not compute is an error, never silently dropped (plain_causal keeps such
    # targets on transformers' path; this guards a model that passes them anyway)
    unsupported = [name for name, value in (("attention_mask", attention_mask), *((k, kwargs.get(k)) for k in
                   ("softcap", "s_aux", "sliding_window"))) if value is not None]
    if unsupported:
        raise ValueError(f"{CAUSAL_ATTENTION} attention is plain causal; it was given {', '.join(unsupported)}")
    out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=query.shape[2] > 1,
                                         scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _register_causal_attention():
    from transformers import AttentionInterface

    AttentionInterface.register(CAUSAL_ATTENTION, causal_attention)


# Families whose attention is plain causal softmax attention (no soft-capping, sinks or
# bidirectional parts): the only ones switched. Any other keeps transformers' own path.
PLAIN_CAUSAL_MODELS = ("llama", "mistral", "qwen2", "qwen3")


def plain_causal(config) -> bool:
    """Whether every layer of this target attends causally over all earlier tokens through sdpa
    (a listed family, no sliding window): what `causal_attention` computes."""
    layer_types = getattr(config, "layer_types", None)
    return (config._attn_implementation == "sdpa" and getattr(config, "model_type", None) in PLAIN_CAUSAL_MODELS
            and getattr(config, "is_causal", True) is not False
            and getattr(config, "sliding_window", None) is None and not getattr(config, "use_sliding_window", False)
            and all(t == "full_attention" for t in layer_types or ()))


def final_norm_weight(model) -> torch.Tensor:
    """The target's final norm as the weight of a Llama-style RMSNorm (weight * normalised), what
    a drafter's copy of it needs: Gemma's norms multiply by 1 + w (stored w)."""
    w = model.model.norm.weight
    return w + 1 if str(getattr(model.config, "model_type", "")).startswith("gemma") else w


def decoder_mask(config, visible: torch.Tensor, key_pos: torch.Tensor, query_pos: torch.Tensor):
    """A custom mask visible [q,k] bool (True: the query sees the key) as the decoder's
    attention_mask. transformers hands a custom 4D mask to every layer as it is, so for a target
    with sliding-window layers the window is applied here: keys at positions <= the query's
    position - sliding_window hidden (key_pos [k], query_pos [q]), on every layer where the
    config has no layer_types (Mistral), else on the "sliding_attention" layers of a mask per
    layer type (Gemma-3, windowed Qwen), the form those decoders take."""
    full = visible[None, None]
    window = getattr(config, "sliding_window", None)
    if not window:
        return full
    near = (visible & (key_pos[None, :] > query_pos[:, None] - window))[None, None]
    if getattr(config, "layer_types", None) is None:
        return near
    return {"full_attention": full, "sliding_attention": near}


@contextmanager
def attention_implementation(config, name: str):
    """The decoder's attention switched to `name` for one call (the config is shared by its layers)."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


class Target(nn.Module):
    def __init__(self, model, aux_layer_ids: list[int]):
        super().__init__()
        self.model = model
        L = self.num_layers
        for i in aux_layer_ids:
            if not 0 <= i < L:
                raise ValueError(f"layer id {i} is out of range for this {L}-layer target (0..{L - 1})")
        self.aux_layer_ids = list(aux_layer_ids)
        self._captured: dict[int, torch.Tensor] = {}
        for i in set(aux_layer_ids):
            self.decoder.layers[i].register_forward_hook(self._capture(i))

    def _capture(self, i):
        def hook(_module, _inputs, output):
            self._captured[i] = output[0] if isinstance(output, tuple) else output
        return hook

    @classmethod
    def load(cls, spec: str, aux_layer_ids: list[int], dtype=torch.float32, device=None) -> "Target":
        from transformers import AutoModelForCausalLM

        from models.zoo import resolve_target

        model = AutoModelForCausalLM.from_pretrained(resolve_target(spec), dtype=dtype)
        if device is not None:
            model.to(device)
        return cls(model.eval(), aux_layer_ids)

    # ------------------------------------------------------------------ shape facts
    @property
    def decoder(self):
        return self.model.model

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight  # [V, Ht]

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids, attention_mask=None, position_ids=None) -> TargetOutput:
        self._captured.clear()
        if attention_mask is None and position_ids is None and plain_causal(self.config):
            _register_causal_attention()
            with attention_implementation(self.config, CAUSAL_ATTENTION):
                out = self.decoder(input_ids=input_ids, use_cache=False)
        else:
            out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        aux = torch.cat([self._captured[i] for i in self.aux_layer_ids], dim=-1) if self.aux_layer_ids else None
        self._captured.clear()
        return TargetOutput(aux=aux, last_hidden=out.last_hidden_state)

    @torch.no_grad()
    def head_outputs(self, last_hidden, draft_ids=None, chunk_rows: int = 2048):
        """Chunk-wise head: (teacher probs [B,T,Vd] over the draft vocab or None, greedy [B,T]).

        Teacher probs are the target's softmax restricted (renormalised) to the draft vocab;
        greedy is the argmax over the full vocabulary (what acceptance is judged against).
        """
        B, T, H = last_hidden.shape
        flat = last_hidden.reshape(-1, H)
        W = self.head_weight
        cap = getattr(self.config, "final_logit_softcapping", None)
        greedy = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
        probs = None if draft_ids is None else torch.empty(flat.shape[0], draft_ids.numel(), dtype=last_hidden.dtype, device=flat.device)
        for start in range(0, flat.shape[0], chunk_rows):
            logits = F.linear(flat[start : start + chunk_rows], W)  # [rows, V]
            if cap:  # the head's final soft-capping (Gemma), where the config has it
                logits = torch.tanh(logits / cap) * cap
            greedy[start : start + chunk_rows] = logits.argmax(-1)
            if probs is not None:
                probs[start : start + chunk_rows] = torch.softmax(logits[:, draft_ids].float(), -1).to(probs.dtype)
        return (None if probs is None else probs.view(B, T, -1)), greedy.view(B, T)

    @torch.no_grad()
    def greedy_after_chains(self, input_ids, anchors, chains):
        """Target's greedy choice after each token of draft chains grafted onto one sequence.

        input_ids [T] (one unpadded sequence); anchors [m]: chain i continues the context
        x_0..x_{a_i + 1}; chains [m, c]: drafted tokens at positions a_i+2 .. a_i+1+c.
        Returns [m, c]: the target's greedy next token after each chain token, from one
        forward over [sequence; all chains] with a mask that keeps every chain to its own
        context (a tree-attention verify of all anchors at once).
        """
        m, c = chains.shape
        _, greedy = self.head_outputs(self.hidden_after_chains(input_ids, anchors, chains).view(1, m * c, -1))
        return greedy.view(m, c)

    @torch.no_grad()
    def chain_steps(self, input_ids) -> "ChainSteps":
        """An incremental `hidden_after_chains` over one sequence [T] (see ChainSteps)."""
        return ChainSteps(self, input_ids)

    @torch.no_grad()
    def hidden_after_chains(self, input_ids, anchors, chains):
        """The target's last hidden state [m, c, H] after each chain token (same arguments and
        forward as `greedy_after_chains`; sampled acceptance needs the whole distribution)."""
        T = input_ids.shape[0]
        m, c = chains.shape
        dev = input_ids.device
        n = T + m * c
        ids = torch.cat([input_ids, chains.reshape(-1)])[None]
        chain_pos = anchors[:, None] + 2 + torch.arange(c, device=dev)  # [m, c]
        positions = torch.cat([torch.arange(T, device=dev), chain_pos.reshape(-1)])[None]
        mask = torch.zeros(n, n, dtype=torch.bool, device=dev)
        mask[:T, :T] = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        rows = T + torch.arange(m * c, device=dev).view(m, c)
        ctx = torch.arange(T, device=dev)[None, :] <= (anchors[:, None] + 1)  # [m, T]
        mask[rows.reshape(-1)] = torch.cat([ctx.repeat_interleave(c, 0), torch.zeros(m * c, m * c, dtype=torch.bool, device=dev)], 1)
        own = torch.ones(c, c, dtype=torch.bool, device=dev).tril()
        mask[T:, T:] = torch.block_diag(*([own] * m))  # each chain sees its own earlier tokens
        out = self.decoder(input_ids=ids, attention_mask=decoder_mask(self.config, mask, positions[0], positions[0]),
                           position_ids=positions, use_cache=False)
        self._captured.clear()
        return out.last_hidden_state[0, T:].view(m, c, -1)


class ChainSteps:
    """The target's last hidden state after each new token of m chains grafted onto one
    sequence, one token per chain per `step`: what `hidden_after_chains(ids, anchors,
    chain)[:, -1]` gives for the chain so far, for m tokens of work per step instead of the whole
    sequence again. The sequence's keys and values are computed once (a cache); each chain's
    tokens join it as they come, and `start` drops them for the next window's chains.

    Cache layout after s steps: [sequence (T); step 0's m tokens; ...; step s-1's m tokens];
    the query of chain j at step s sees the sequence up to x_{a_j+1}, its own earlier tokens
    (T + s'*m + j) and itself, at position a_j + 2 + s."""

    def __init__(self, target: Target, input_ids: torch.Tensor):
        from transformers import DynamicCache

        self.target, self.T = target, input_ids.shape[0]
        # a windowed target's own cache would keep only the last window of keys on its sliding
        # layers: every key is kept here, and `decoder_mask` hides what the window hides
        windowed = bool(getattr(target.config, "sliding_window", None))
        self.cache = DynamicCache() if windowed else DynamicCache(config=target.config)
        target.decoder(input_ids=input_ids[None], past_key_values=self.cache, use_cache=True)
        target._captured.clear()
        self.anchors, self.steps = None, 0

    def start(self, anchors: torch.Tensor):
        """New chains at anchors [m]: the cache back to the sequence alone."""
        extra = self.cache.get_seq_length() - self.T
        if extra:
            self.cache.crop(-extra)  # a negative count removes that many (the form every version reads)
        self.anchors, self.steps = anchors, 0

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [m]: each chain's next token → the hidden state after it [m, H]."""
        m, T, s, dev = tokens.numel(), self.T, self.steps, tokens.device
        mask = torch.zeros(m, T + (s + 1) * m, dtype=torch.bool, device=dev)
        mask[:, :T] = torch.arange(T, device=dev)[None, :] <= (self.anchors[:, None] + 1)
        own = T + torch.arange(s + 1, device=dev)[None, :] * m + torch.arange(m, device=dev)[:, None]  # [m, s+1]
        mask.scatter_(1, own, True)
        positions = (self.anchors + 2 + s)[None]
        key_pos = torch.cat([torch.arange(T, device=dev),
                             (self.anchors[None, :] + 2 + torch.arange(s + 1, device=dev)[:, None]).reshape(-1)])
        out = self.target.decoder(input_ids=tokens[None], attention_mask=decoder_mask(self.target.config, mask, key_pos,
                                                                                      positions[0]),
                                  position_ids=positions,
                                  past_key_values=self.cache, use_cache=True)
        self.target._captured.clear()
        self.steps += 1
        return out.last_hidden_state[0]
