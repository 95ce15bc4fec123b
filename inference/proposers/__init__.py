"""Draft proposers behind one small interface, written as typing.Protocols in
inference/proposers/base.py: `Proposer` (k, aux_layers, begin and the declared capabilities
on_device / tree / feeds_verify / verify_tokens), `HostProposer` (propose, accepted: the host
loop), `DeviceProposer` (drafts, draft, advance: the device loop, captured in CUDA graphs),
`TreeProposer` (draft_tree), and the extras `SampledProposer` (propose_sampled),
`SampledDeviceProposer` (draft_sampled), `GraphedBegin` (begin_graphed) and `Ending` (end).
The runtime reads a proposer's `capabilities` once per loop, checked against what it implements.

    aux_layers                    target layers whose outputs the proposer needs (may be ())
    begin(prompts, aux, first)    after prefill: prompt tokens, their aux features [B,T,n*Ht],
                                  the first generated token of each row
    propose(tokens) -> drafts     per row, at most k target token ids (tokens: prompt + output)
    accepted(fed, aux, counts, active)
                                  after verification: the k+1 tokens each row fed [B,k+1],
                                  their aux features [B,k+1,n*Ht], (accepted, bonus) per row,
                                  and which rows still generate after this step
    draft() -> drafts [B,k]       (device) greedy drafts (a static buffer; -1 = no draft)
    draft_sampled(T, generator) -> (drafts [B,k], q [B,k,V])
    advance(fed, aux, accepted, bonus, active)
                                  (device) `accepted` as tensors
"""
from inference.proposers.base import (Capabilities, DeviceProposer, Ending, GraphedBegin, HostProposer, Proposer,
                                      SampledDeviceProposer, SampledProposer, TreeProposer, capabilities)
from inference.proposers.draft_model import DraftModelProposer, vocab_intersection
from inference.proposers.drafters import Eagle3Proposer, MedusaProposer, RecomputeProposer, drafter_proposer
from inference.proposers.model_free import GpuNgramProposer, NgramProposer, SuffixProposer, longest_suffix_match

__all__ = ["Capabilities", "DeviceProposer", "Ending", "GraphedBegin", "HostProposer", "Proposer", "SampledDeviceProposer",
           "SampledProposer", "TreeProposer", "capabilities", "DraftModelProposer", "Eagle3Proposer", "GpuNgramProposer", "MedusaProposer", "NgramProposer",
           "RecomputeProposer", "SuffixProposer", "drafter_proposer", "longest_suffix_match", "vocab_intersection"]
