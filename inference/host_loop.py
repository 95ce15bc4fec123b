"""The host loop of speculative decoding: proposers that draft on the host (suffix decoding, the
host n-gram, drafting across vocabularies) or that the device loop does not serve.

Each step the host asks the proposer for drafts, the target verifies them (one CUDA graph on a
GPU), and the host reads the accepted lengths back: two host syncs per step, the price of a
proposer that works on Python lists. `generate` (inference/engine.py) picks this loop only for
proposers that are not `on_device`.
"""
from __future__ import annotations

import time

import torch

from inference.graphs import kernels_mode, reuse
from inference.model import GraphedStep
from inference.verify import NO_DRAFT, block_verify, greedy_verify, rejection_verify, sampling_probs, synthetic_verify


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def host_speculation(model, cache, proposer, prompts, aux, nxt, k: int, max_new_tokens: int, eos_ids, stats, cuda_graphs: bool,
                     temperature: float, top_k: int, top_p: float, verification: str, generator) -> list[list[int]]:
    """The speculative steps of `generate` after the prefill, in the host loop: `nxt` [B] holds
    each row's first token; fills `stats` (steps, histograms, draft / verify time, host syncs)
    and returns the outputs. proposer None (k = 0): plain decoding, one token per step."""
    device = model.embed_tokens.weight.device
    B = len(prompts)
    aux_layers = tuple(getattr(proposer, "aux_layers", ()))
    if proposer is not None:
        proposer.begin(prompts, aux, nxt)
    step_fn = None
    if cuda_graphs and device.type == "cuda" and getattr(model, "graphable", True):
        graph = reuse(model, ("step", id(cache), B, k + 1, aux_layers, kernels_mode()),
                      lambda: GraphedStep(model, cache, B, k + 1, aux_layers))
        step_fn = graph
    offsets = torch.arange(k + 1, device=device)
    # the step's inputs go up through one pinned buffer, rewritten each step (the previous copy
    # has landed by then: every step ends reading its result back)
    pinned = torch.empty(B, 2 + k, dtype=torch.long).pin_memory() if device.type == "cuda" else None
    tokens = [list(p) for p in prompts]
    outputs: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    for b in range(B):
        _emit(b, [nxt[b]], tokens, outputs, done, eos_ids, max_new_tokens)

    while not all(done):
        t0 = time.perf_counter()
        drafts = [[NO_DRAFT] * k for _ in range(B)]
        draft_probs = None
        if k and temperature > 0 and hasattr(proposer, "propose_sampled"):
            # drafters with distributions sample their drafts and hand q to verification
            proposed, draft_probs = proposer.propose_sampled(tokens, temperature, generator)
            for b, d in enumerate(proposed):
                if not done[b]:
                    drafts[b][: min(len(d), k)] = d[:k]
        elif k:
            for b, d in enumerate(proposer.propose(tokens)):  # a proposer may draft more than k
                if not done[b]:
                    drafts[b][: min(len(d), k)] = d[:k]
        _sync(device)
        t1 = time.perf_counter()
        # each row feeds its last token followed by its drafts, at its own positions: one host
        # tensor [B, 2+k] (first position, last token, drafts), one copy to the device
        host = torch.tensor([[len(t) - 1, t[-1], *d] for t, d in zip(tokens, drafts)], dtype=torch.long)
        packed = pinned.copy_(host).to(device, non_blocking=True) if pinned is not None else host
        draft_t = packed[:, 2:]
        step = torch.cat([packed[:, 1:2], draft_t.clamp_min(0)], 1)
        positions = packed[:, :1] + offsets
        if step_fn is not None:
            logits, aux = step_fn(step, positions)
        else:
            logits, aux = model(step, positions, cache, aux_layers)
        if verification.startswith("synthetic:"):
            accepted, bonus = synthetic_verify(draft_t, float(verification.split(":", 1)[1]), logits, generator)
        elif temperature > 0:
            verify = block_verify if verification == "block" else rejection_verify
            q = None if draft_probs is None else draft_probs[:, :k].to(logits.device)
            accepted, bonus = verify(draft_t, q, sampling_probs(logits, temperature, top_k, top_p), generator)
        else:
            accepted, bonus = greedy_verify(draft_t, logits)
        accepted, bonus = torch.stack([accepted, bonus]).tolist()  # one read back
        stats.host_syncs += 2  # the sync that ends the draft timing, the verification's result read back
        for b in range(B):
            if done[b]:
                continue
            if k:
                stats.row_histograms[b][accepted[b]] += 1
            _emit(b, drafts[b][: accepted[b]] + [bonus[b]], tokens, outputs, done, eos_ids, max_new_tokens)
        if k:
            # after _emit: a row that has just finished is no longer active, so a proposer with
            # its own cache keeps it in place rather than advancing it by tokens past its budget
            # (still computed with the batch, it would otherwise write past the cache's end)
            proposer.accepted(step, aux, list(zip(accepted, bonus)), [not d for d in done])
        t2 = time.perf_counter()
        stats.draft_seconds += t1 - t0
        stats.verify_seconds += t2 - t1
        stats.steps += 1
    stats.histogram = [sum(column) for column in zip(*stats.row_histograms)]
    if proposer is not None and hasattr(proposer, "end"):
        proposer.end(outputs)  # e.g. suffix decoding caches finished responses
    return outputs


def _emit(b, new, tokens, outputs, done, eos_ids, max_new_tokens):
    """Append accepted tokens to row b, stopping at end-of-sequence or the token budget.

    A finished row's cache positions are never advanced again, so its later (ignored) steps
    write only beyond its end."""
    for t in new:
        if len(outputs[b]) >= max_new_tokens:
            break
        outputs[b].append(t)
        tokens[b].append(t)
        if t in eos_ids:
            break
    if len(outputs[b]) >= max_new_tokens or (outputs[b] and outputs[b][-1] in eos_ids):
        done[b] = True
