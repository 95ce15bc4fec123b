"""The slow path for architectures the runtime does not implement (transformers' own model
behind the runtime model's interface) and `load_runtime`, which picks the fast or the slow path
for a target folder."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from draftsmith_kernels.settings import KernelSettings
from inference.runtime.model import SUPPORTED, RuntimeModel


class TokenBuffer:
    """The fallback's 'cache': the token ids written at each row's positions [B, S]. Like the
    KV cache, entries beyond a row's position are stale and never seen by a causal query."""

    def __init__(self, batch: int, max_len: int, device):
        self.ids = torch.zeros(batch, max_len, dtype=torch.long, device=device)

    @property
    def max_len(self) -> int:
        return self.ids.shape[1]


class TransformersFallback(nn.Module):
    """Slow path for architectures the runtime does not implement: transformers' own model,
    the whole prefix recomputed at every step (no KV cache, no CUDA graph), behind the
    runtime model's interface, so every proposer and verifier works unchanged."""

    graphable = False
    kernels: KernelSettings = KernelSettings()  # the proposers' and verifiers' kernels (RuntimeModel.kernels)

    def __init__(self, hf_model):
        super().__init__()
        self.hf = hf_model.eval()
        c = hf_model.config
        self.config = _FallbackConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers)
        self.embed_tokens = hf_model.get_input_embeddings()

    def new_cache(self, batch: int, max_len: int) -> TokenBuffer:
        return TokenBuffer(batch, max_len, self.embed_tokens.weight.device)

    def forward(self, input_ids, positions, cache: TokenBuffer, aux_layers: tuple = (), logits_at=None,
                causal_prefill: bool = False):
        B, q = input_ids.shape
        cache.ids.scatter_(1, positions, input_ids)
        upto = int(positions.max()) + 1
        out = self.hf(input_ids=cache.ids[:, :upto], output_hidden_states=bool(aux_layers), use_cache=False)
        rows = torch.arange(B, device=input_ids.device)[:, None]
        index = positions if logits_at is None else positions[rows[:, 0], logits_at][:, None]
        logits = out.logits[rows, index]
        aux = None
        if aux_layers:
            L = self.config.num_layers
            # transformers' hidden_states[i + 1] is the output of layer i (the last one normed,
            # which is exactly what id L, the final hidden state, asks for)
            aux = torch.cat([out.hidden_states[min(i, L - 1) + 1][rows, positions] for i in aux_layers], -1)
        return logits, aux


@dataclass
class _FallbackConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int


_warned_fallback = set()


def load_runtime(folder: str | Path, dtype=torch.float32, device="cpu", kernels: KernelSettings | None = None):
    """The runtime model for a target folder: the fast implementation for the model types in
    SUPPORTED (Llama, Mistral, Qwen2, Qwen3, Gemma-3; docs/targets.md), transformers' model on
    the slow path otherwise (said once in the log). kernels: the model's kernel settings
    (default: KernelSettings())."""
    import logging

    from transformers import AutoConfig, AutoModelForCausalLM

    kind = AutoConfig.from_pretrained(folder).model_type
    if kind in SUPPORTED:
        model = RuntimeModel.from_pretrained(folder, dtype=dtype, device=device)
    else:
        if kind not in _warned_fallback:
            _warned_fallback.add(kind)
            logging.getLogger("draftsmith.runtime").warning(
                "model_type %r has no runtime implementation (%s): running transformers' model on the slow path "
                "(whole prefix recomputed each step, no CUDA graphs)", kind, ", ".join(sorted(SUPPORTED)))
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
        model = TransformersFallback(hf)
    if kernels is not None:
        model.kernels = kernels
    return model
