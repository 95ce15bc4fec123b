"""The runtime's fixed-shape steps outside the speculative loop: the prefill and plain greedy
decoding, each captured in a CUDA graph on a GPU (inference/runtime/graphs.py) and reused by later
calls of the same shape (the engine keeps them on the model).
"""
from __future__ import annotations

import torch

from inference.runtime.graphs import capture_graph, kernel_settings, reuse
from draftsmith_kernels.argmax import argmax_rows

PREFILL_BUCKET = 64  # prompts are padded to a multiple of this: few prefill shapes, graphs reused
# larger prefills run eagerly: they are bound by compute, not by launches, and a captured graph
# would keep its activations (B x width x intermediate) allocated for good
PREFILL_GRAPH_MAX_TOKENS = 8192


def prefill(model, cache, prompts: list[list[int]], aux_layers: tuple, graphed: bool):
    """Every row's prompt into the cache from position 0, right-padded.

    Returns (logits [B,1,V] at each row's last prompt token, aux [B,T,n*H] at positions 0..T-1
    with T the longest prompt, or None). On a GPU a small prefill (up to PREFILL_GRAPH_MAX_TOKENS
    padded tokens) is a CUDA-graph replay for the prompts' length rounded up to PREFILL_BUCKET:
    an eager prefill launches every layer's kernels from Python, a fixed cost each answer pays. Padding tokens sit at positions beyond
    their row's prompt: no real query sees them, and decoding overwrites them."""
    B, T = len(prompts), max(len(p) for p in prompts)
    padded = torch.zeros(B, T, dtype=torch.long)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = torch.as_tensor(p)
    last = torch.as_tensor([len(p) - 1 for p in prompts])
    device = model.embed_tokens.weight.device
    width = min(-(-T // PREFILL_BUCKET) * PREFILL_BUCKET, cache.max_len)
    if not graphed or B * width > PREFILL_GRAPH_MAX_TOKENS:
        positions = torch.arange(T, device=device).expand(B, T)
        return model(padded.to(device), positions, cache, aux_layers, logits_at=last.to(device), causal_prefill=True)
    step = reuse(model, ("prefill", id(cache), B, width, aux_layers, kernel_settings()),
                  lambda: PrefillStep(model, cache, B, width, aux_layers))
    logits, aux = step(padded, last)
    return logits, (None if aux is None else aux[:, :T])


class PrefillStep:
    """A captured prefill of B rows padded to `width` tokens: static ids [B,width] and last
    index [B] in, the graph's own logits [B,1,V] and aux [B,width,n*H] out (overwritten by the
    next replay: read them before another prefill of this shape)."""

    def __init__(self, model, cache, batch: int, width: int, aux_layers: tuple):
        dev = model.embed_tokens.weight.device
        # every tensor the graph reads lives on self: a captured graph holds raw addresses, so
        # a tensor freed after capture would be reused by other allocations under the graph
        self.cache = cache
        self.ids = torch.zeros(batch, width, dtype=torch.long, device=dev)
        self.last = torch.zeros(batch, dtype=torch.long, device=dev)
        self.positions = torch.arange(width, device=dev).expand(batch, width)

        def forward():
            self.logits, self.aux = model(self.ids, self.positions, cache, aux_layers, logits_at=self.last,
                                          causal_prefill=True)

        # the warm-up writes the cache's first `width` positions, which every prefill rewrites
        self.graph = capture_graph(forward)

    def __call__(self, padded: torch.Tensor, last: torch.Tensor):
        self.ids.zero_()
        self.ids[:, : padded.shape[1]].copy_(padded, non_blocking=True)
        self.last.copy_(last, non_blocking=True)
        self.graph.replay()
        return self.logits, self.aux


class GreedyDecodeStep:
    """One plain greedy step that feeds itself: reads ids / positions [B,1], writes the argmax
    back into ids and advances positions. On a GPU it is one CUDA-graph replay with nothing
    for the host to wait on."""

    def __init__(self, model, cache, batch: int, graphed: bool):
        dev = model.embed_tokens.weight.device
        self.model, self.cache = model, cache
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        # the warm-up writes into the cache: its contents are put back
        self.graph = capture_graph(self._step, restore=(cache.k, cache.v)) if graphed else None

    def _step(self):
        logits, _ = self.model(self.ids, self.positions, self.cache)
        argmax_rows(logits[:, -1], self.ids[:, 0])  # two short launches, written in place
        self.positions.add_(1)

    def __call__(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()


EOS_CHECK_EVERY = 16  # plain greedy: tokens between the host's checks for end-of-sequence


def plain_greedy(model, cache, first, lengths, max_new_tokens: int, eos_ids, graphed: bool) -> tuple[list[list[int]], int]:
    """first [B] (the prefill's argmax), lengths [B] → (each row's tokens, cut after its EOS;
    the host syncs it took)."""
    B = first.shape[0]
    step = reuse(model, ("plain", id(cache), B, graphed, kernel_settings()),
                  lambda: GreedyDecodeStep(model, cache, B, graphed))
    step.ids[:, 0] = first
    step.positions[:, 0] = lengths  # the first new token sits right after the prompt
    history = torch.empty(B, max_new_tokens, dtype=torch.long, device=first.device)
    history[:, 0] = first
    eos = torch.as_tensor(list(eos_ids), dtype=torch.long, device=first.device)
    n, syncs = 1, 1  # the final read (the first tokens stay on the device)
    while n < max_new_tokens:
        if eos.numel() and n % EOS_CHECK_EVERY == 0:
            syncs += 1
            if bool(torch.isin(history[:, :n], eos).any(1).all()):
                break  # every row has ended (one host sync per EOS_CHECK_EVERY tokens)
        step()
        history[:, n] = step.ids[:, 0]
        n += 1
    outputs = []
    for row in history[:, :n].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        outputs.append(row[:cut])
    return outputs, syncs
