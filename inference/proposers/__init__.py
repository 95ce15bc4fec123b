"""Draft proposers behind one small interface.

    aux_layers                    target layers whose outputs the proposer needs (may be ())
    begin(prompts, aux, first)    after prefill: prompt tokens, their aux features [B,T,n*Ht],
                                  the first generated token of each row
    propose(tokens) -> drafts     per row, at most k target token ids (tokens: prompt + output)
    accepted(fed, aux, counts, active)
                                  after verification: the k+1 tokens each row fed [B,k+1],
                                  their aux features [B,k+1,n*Ht], (accepted, bonus) per row,
                                  and which rows still generate after this step (a row
                                  that has just finished is not: its state may stay put)

Positions are 0-based. A row holding tokens t_0..t_{N-1} feeds t_{N-1} and its drafts at
positions N-1.. in the verify step.

Device proposers (`on_device = True`) also provide the loop's own interface, which runs on
tensors alone, so the engine captures it in CUDA graphs (inference/runtime/spec_loop.py):

    draft() -> drafts [B,k]       greedy drafts (a static buffer; -1 = no draft)
    draft_sampled(T, generator) -> (drafts [B,k], q [B,k,V])
                                  drafts sampled from the proposer's own distribution q
    advance(fed, aux, accepted, bonus, active)
                                  `accepted` as tensors: fed [B,k+1], aux [B,k+1,n*Ht] or None,
                                  accepted [B], bonus [B], active [B] bool

These never wait on the host (no .item(), .tolist(), branches on tensor values), keep fixed
shapes, and update their state tensors in place, so a captured replay sees the same storage.
"""
from inference.proposers.draft_model import DraftModelProposer, vocab_intersection
from inference.proposers.drafters import Eagle3Proposer, MedusaProposer, RecomputeProposer, drafter_proposer
from inference.proposers.model_free import GpuNgramProposer, NgramProposer, SuffixProposer, longest_suffix_match

__all__ = ["DraftModelProposer", "Eagle3Proposer", "GpuNgramProposer", "MedusaProposer", "NgramProposer",
           "RecomputeProposer", "SuffixProposer", "drafter_proposer", "longest_suffix_match", "vocab_intersection"]
