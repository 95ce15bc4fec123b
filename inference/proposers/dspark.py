"""The DSpark device proposer: DFlash's cached block drafting (inference/proposers/blocks.py) plus
DSpark's two heads (models/dspark.py): one backbone forward for the block, then the Markov bias
position by position, left to right (position j's bias reads draft j-1), giving drafts and the
confidence head's per-position acceptance estimates, which adaptive verification reads
(inference/runtime/adaptive.py).

The left-to-right stage is the drafter's own `markov_walk`, the function training's walks draft
with (`draft_at` greedy, `drive_block` sampled), on the hidden states the cached backbone gives:
the runtime drafts what the walk drafts, draft for draft. Greedy picks the draft row's argmax;
sampling draws each position from softmax(logits / T) by inverse CDF (`_pick`, as DFlash's) and
records that softmax as q. Everything stays on the device with fixed shapes (k small launches of
the Markov stage per draft), so the step is captured in CUDA graphs like DFlash's.

Shapes: B rows, k drafts, H hidden, r Markov rank, Vd draft vocab, V target vocab.
"""
from __future__ import annotations

import torch

from inference.proposers.blocks import DFlashCachedProposer


class DSparkCachedProposer(DFlashCachedProposer):
    """DFlashCachedProposer's context cache and block forward; DSpark's Markov walk on top.

    `confidence` [B,k] float32: P(draft j accepted | drafts < j were) as the confidence head
    estimates it; absent where the drafter has no confidence head, so that the proposer is no
    ConfidentProposer and adaptive verification refuses it (constant confidences would choose the
    width from the costs alone)."""

    def __init__(self, drafter, k: int, batch: int, max_len: int, target_config):
        if not hasattr(drafter, "markov_walk"):
            raise ValueError(f"{type(drafter).__name__} is not a DSpark drafter (no Markov head)")
        super().__init__(drafter, k, batch, max_len, target_config)
        if getattr(drafter, "confidence_head", None) is not None:
            self.confidence = torch.ones(batch, k, dtype=torch.float32, device=self.device)

    @torch.no_grad()
    def _draft(self, temperature, generator):
        hidden = self._block_hidden()  # [B,k,H]: the backbone, one forward for the block

        def pick(logits, j):  # logits [B,Vd] of draft j (0-based), its Markov bias applied
            self._pick(j, logits, temperature, generator)
            return self.drafts[:, j]

        _, confidence = self.drafter.markov_walk(hidden, self.bonus, pick)  # (drafts: written by pick) [B,k] or None
        if confidence is not None:
            self.confidence.copy_(confidence)
