"""The host loop of speculative decoding: proposers that draft on the host (suffix decoding, the
host n-gram, drafting across vocabularies) or that the device loop does not serve.

Each step the host asks the proposer for drafts, the target verifies them (one CUDA graph on a
GPU), and the host reads the accepted lengths back: two host syncs per step, the price of a
proposer that works on Python lists. `generate` (inference/runtime/engine.py) picks this loop only for
proposers that are not `on_device`.
"""
from __future__ import annotations

import time

import torch

from inference.runtime.graphs import kernel_settings, reuse
from inference.proposers.base import capabilities
from inference.runtime.model import GraphedStep
from inference.runtime.verify import NO_DRAFT, block_verify, greedy_verify, rejection_verify, sampling_probs, synthetic_verify


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
    caps = capabilities(proposer)  # what it declares, checked once (inference/proposers/base.py)
    aux_layers = caps.aux_layers
    if proposer is not None:
        proposer.begin(prompts, aux, nxt)
    step_fn = greedy_step = None
    if cuda_graphs and device.type == "cuda" and getattr(model, "graphable", True):
        if temperature == 0 and not verification.startswith("synthetic:") and k:
            # greedy: input, forward and verification in one graph (one copy up, one replay, one read)
            greedy_step = reuse(model, ("host-greedy", id(cache), B, k, aux_layers, kernel_settings()),
                                lambda: GraphedGreedyVerify(model, cache, B, k, aux_layers))
        else:
            step_fn = reuse(model, ("step", id(cache), B, k + 1, aux_layers, kernel_settings()),
                            lambda: GraphedStep(model, cache, B, k + 1, aux_layers))
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
        if k and temperature > 0 and caps.propose_sampled:
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
        if greedy_step is not None:
            step, aux, result = greedy_step(pinned.copy_(host))
            accepted, bonus = result.tolist()  # one read back
        else:
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
    if caps.end:
        proposer.end(outputs)  # e.g. suffix decoding caches finished responses
    return outputs


class GraphedGreedyVerify:
    """The host loop's greedy verify step as one CUDA graph: from one packed input [B, 2+k]
    (each row's first position, last token, k drafts; NO_DRAFT where a row drafted fewer) to the
    fed tokens [B,k+1], the aux features and (accepted, bonus) [2,B]. The host copies the input
    up, replays, reads the result: the ~10 small launches around a graphed forward (the input's
    cat and positions, the verification) no longer wait for the host after each step's sync."""

    def __init__(self, model, cache, batch: int, k: int, aux_layers: tuple):
        from inference.runtime.graphs import capture_graph

        dev = model.embed_tokens.weight.device
        # every tensor the graph reads lives on self: a captured graph holds raw addresses, and a
        # tensor freed after capture is handed to other allocations (a tensor kept only by the
        # capturing closure gets overwritten, and the replays read garbage positions)
        self.cache = cache  # the graph writes into it
        self.packed = torch.zeros(batch, 2 + k, dtype=torch.long, device=dev)
        self.packed[:, 2:] = NO_DRAFT
        self.offsets = torch.arange(k + 1, device=dev)

        def step():
            drafts = self.packed[:, 2:]
            self.fed = torch.cat([self.packed[:, 1:2], drafts.clamp_min(0)], 1)  # [B,k+1]
            logits, self.aux = model(self.fed, self.packed[:, :1] + self.offsets, cache, aux_layers)
            self.result = torch.stack(greedy_verify(drafts, logits))  # [2,B]

        self.graph = capture_graph(step, restore=(cache.k, cache.v))  # the warm-up writes into the cache

    def __call__(self, packed: torch.Tensor):
        """packed [B, 2+k] (pinned host memory or a device tensor) → (fed, aux, result), the
        graph's own buffers (overwritten by the next replay)."""
        self.packed.copy_(packed, non_blocking=True)
        self.graph.replay()
        return self.fed, self.aux, self.result


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
