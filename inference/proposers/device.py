"""What every device proposer offers the host loop, written once on top of its device interface
(`draft`, `draft_sampled`, `advance`; see inference/proposers/model_free.py): the host loop hands tokens
as lists and counts as (accepted, bonus) pairs, the device loop hands tensors.
"""
from __future__ import annotations

import torch

from inference.proposers.base import DeviceProposer, HostProposer


def check_drafter_fits(drafter, k: int, target_config) -> None:
    """The MTP / DFlash drafter was trained for this target and drafts at least k tokens."""
    cfg = drafter.config
    if cfg.vocab_size != target_config.vocab_size or cfg.hidden_size != target_config.hidden_size:
        raise ValueError(f"this drafter was trained for another target: vocab {cfg.vocab_size} / hidden {cfg.hidden_size} "
                         f"vs {target_config.vocab_size} / {target_config.hidden_size}")
    capability = drafter.train_steps(k)
    if k > capability:
        raise ValueError(f"k={k}: this {type(drafter).__name__} drafts at most {capability} tokens per step")


def advance_args(device, fed, aux, counts, active):
    """The host loop's (fed, aux, [(accepted, bonus)], [active]) as `advance`'s tensors."""
    return (torch.as_tensor(fed, device=device), aux, torch.as_tensor([c for c, _ in counts], device=device),
            torch.as_tensor([b for _, b in counts], device=device), torch.as_tensor(active, dtype=torch.bool, device=device))


class HostLoopInterface(HostProposer, DeviceProposer):
    """`propose`, `propose_sampled` and `accepted` of a device proposer (its `drafts` buffer
    tells the device)."""

    on_device = True  # draft / advance run in the engine's device loop

    def propose(self, tokens: list[list[int]]) -> list[list[int]]:
        return self.draft().tolist()

    def propose_sampled(self, tokens, temperature: float, generator=None):
        drafts, q = self.draft_sampled(temperature, generator)
        return drafts.tolist(), q

    def accepted(self, fed, aux, counts, active):
        self.advance(*advance_args(self.drafts.device, fed, aux, counts, active))
