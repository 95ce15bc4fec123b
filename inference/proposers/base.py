"""The proposer interface as typing.Protocols, and the capabilities a proposer declares.

Every proposer is a `Proposer` (its draft length, the target layers it reads, `begin`, and its
declared capabilities). One that runs in the host loop speaks `HostProposer`; one that declares
`on_device = True` speaks the device loop's `DeviceProposer`, which the engine captures in CUDA
graphs (most device proposers speak both); one that declares `tree = True` drafts trees
(`TreeProposer`, inference/tree/plan.py; `FeedingTreeProposer` where it `feeds_verify`).
Optional extras are further protocols: sampled drafting (`SampledProposer` on the host,
`SampledDeviceProposer` on the device), a graphed begin (`GraphedBegin`), a hook at the end
of a generation (`Ending`) and the drafts' estimated acceptance (`ConfidentProposer`: what adaptive
verification reads).

The runtime reads these once per loop through `capabilities(proposer)`, which also checks that
what a proposer declares it implements (a TypeError naming the missing members otherwise), so
no part of the runtime probes a proposer with getattr / hasattr.

Positions are 0-based. A row holding tokens t_0..t_{N-1} feeds t_{N-1} and its drafts at
positions N-1.. in the verify step. Device-loop methods never wait on the host (no .item(),
.tolist(), branches on tensor values), keep fixed shapes, and update their state tensors in
place, so a captured replay sees the same storage.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch


@runtime_checkable
class Proposer(Protocol):
    """What every proposer offers."""

    k: int  # drafts per step (a tree: its depth)

    # declared capabilities (class variables, or instance attributes set in __init__); a
    # proposer that leaves one out has the default given here
    aux_layers: ClassVar[tuple] = ()  # target layers whose outputs the proposer needs
    on_device: ClassVar[bool] = False  # also speaks DeviceProposer: runs in the engine's device loop
    tree: ClassVar[bool] = False  # drafts trees (TreeProposer); the device loop runs a TreeLoop
    feeds_verify: ClassVar[bool] = False  # a tree proposer whose draft also writes the verify step's input
    verify_tokens: ClassVar[int | None] = None  # drafted tokens verified per step when not k (a tree's nodes)

    def begin(self, prompts: list[list[int]], aux, first) -> None:
        """After prefill: prompt tokens, their aux features [B,T,n*Ht], each row's first generated token."""


@runtime_checkable
class HostProposer(Proposer, Protocol):
    """The host loop's interface (every proposer the host loop runs: any that is not on_device,
    and a device proposer whose loop cannot run on the device)."""

    def propose(self, tokens: list[list[int]]) -> list[list[int]]:
        """Per row, at most k target token ids (tokens: prompt + output)."""

    def accepted(self, fed, aux, counts, active) -> None:
        """After verification: the k+1 tokens each row fed [B,k+1], their aux features
        [B,k+1,n*Ht], (accepted, bonus) per row, and which rows still generate after this step
        (a row that has just finished is not: its state may stay put)."""


@runtime_checkable
class SampledProposer(Protocol):
    """Host loop, temperature > 0: drafts sampled from the proposer's own distribution q."""

    def propose_sampled(self, tokens: list[list[int]], temperature: float, generator=None):
        """(drafts per row, q [B,k,V])."""


@runtime_checkable
class DeviceProposer(Proposer, Protocol):
    """The device loop's interface (`on_device = True`): tensors only."""

    drafts: torch.Tensor  # [B,k] the static buffer `draft` fills (-1 = no draft)

    def draft(self) -> torch.Tensor:
        """Greedy drafts [B,k]."""

    def advance(self, fed, aux, accepted, bonus, active) -> None:
        """`accepted` as tensors: fed [B,k+1], aux [B,k+1,n*Ht] or None, accepted [B], bonus [B], active [B] bool."""


@runtime_checkable
class SampledDeviceProposer(Protocol):
    def draft_sampled(self, temperature: float, generator=None):
        """(drafts [B,k], q [B,k,V]) sampled from the proposer's own distribution q."""


@runtime_checkable
class ConfidentProposer(Protocol):
    """A device proposer whose draft also estimates each draft's acceptance (DSpark's confidence
    head): what adaptive verification (inference/runtime/adaptive.py) chooses the verify width from."""

    # [B,k] float32, written by draft / draft_sampled: P(draft j accepted | drafts < j were); c[b, j]
    # reads row b's drafts before j only, never draft j or later (sampled steps stay exact)
    confidence: torch.Tensor


@runtime_checkable
class GraphedBegin(Protocol):
    def begin_graphed(self, prompts, aux, first) -> None:
        """`begin` as one graph replay, `first` [B] still on the device (queued behind the prefill)."""


@runtime_checkable
class TreeProposer(Proposer, Protocol):
    """`tree = True`: drafts a tree per step for the device loop (inference/tree/plan.py, TreeLoop),
    which calls these, not a chain's `draft`."""

    verify_tokens: int

    def draft_tree(self):
        """The tree below each row's root (inference/tree/ops.py: Tree)."""

    def advance(self, fed, aux, accepted, bonus, active, aux_rows=None) -> None:
        """The accepted path like a chain: fed [B,D+1] (root, path tokens), aux rows aux_rows [B,D+1]
        of the verify's features flattened, accepted [B], bonus [B], active [B] bool."""


@runtime_checkable
class FeedingTreeProposer(TreeProposer, Protocol):
    """`feeds_verify = True`: TreeLoop reranks the candidates it drafts itself, writing the verify's
    input and making the last verify's cache moves in the same launch, and hands `advance` the next
    tokens and positions its accept launch made (inputs=)."""

    top_k: int
    children: int
    total_tokens: int
    last: torch.Tensor  # [B] the drafter's last step-0 position (the root sits at last + 1)

    def draft_candidates(self):
        """Every candidate of the tree, depth by depth (kernels/tree_select.py: Candidates)."""


@runtime_checkable
class Ending(Protocol):
    def end(self, outputs: list[list[int]]) -> None:
        """After a generation: every row's output (e.g. suffix decoding caches them)."""


@dataclass(frozen=True)
class Capabilities:
    """What one proposer declared, read once: the runtime branches on these fields only."""

    aux_layers: tuple = ()
    on_device: bool = False
    tree: bool = False
    feeds_verify: bool = False
    verify_tokens: int | None = None
    propose_sampled: bool = False  # SampledProposer
    draft_sampled: bool = False  # SampledDeviceProposer
    confidences: bool = False  # ConfidentProposer
    begin_graphed: bool = False  # GraphedBegin
    end: bool = False  # Ending


NONE = Capabilities()  # no proposer: plain decoding


def _declared(proposer, name: str):
    """The proposer's declared value of capability `name`, else the Proposer protocol's default."""
    return getattr(proposer, name, getattr(Proposer, name))


def capabilities(proposer) -> Capabilities:
    """The capabilities `proposer` declares, checked against what it implements: a TypeError
    naming the protocol and its missing members when a declared one is not there. None: NONE."""
    if proposer is None:
        return NONE
    on_device, tree = bool(_declared(proposer, "on_device")), bool(_declared(proposer, "tree"))
    if tree:  # (the device loop's trees: a tree proposer drafts no chains)
        _require(proposer, TreeProposer, "tree = True")
        if _declared(proposer, "feeds_verify"):
            _require(proposer, FeedingTreeProposer, "feeds_verify = True")
    else:
        _require(proposer, DeviceProposer if on_device else HostProposer, f"on_device = {on_device}")
    return Capabilities(aux_layers=tuple(_declared(proposer, "aux_layers")), on_device=on_device, tree=tree,
                        feeds_verify=bool(_declared(proposer, "feeds_verify")),
                        verify_tokens=_declared(proposer, "verify_tokens"),
                        propose_sampled=isinstance(proposer, SampledProposer),
                        draft_sampled=isinstance(proposer, SampledDeviceProposer),
                        confidences=on_device and isinstance(proposer, ConfidentProposer),
                        begin_graphed=isinstance(proposer, GraphedBegin), end=isinstance(proposer, Ending))


DECLARED = ("aux_layers", "on_device", "tree", "feeds_verify", "verify_tokens")  # have defaults


def members(protocol) -> set[str]:
    """The attributes and methods `protocol` and the protocols it extends require."""
    names = set()
    for cls in protocol.__mro__:
        if cls in (Protocol, object) or not getattr(cls, "_is_protocol", False):
            continue
        names |= {n for n in getattr(cls, "__annotations__", {}) if not n.startswith("_")}
        names |= {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}
    return names - set(DECLARED)


def _require(proposer, protocol, why: str) -> None:
    missing = sorted(n for n in members(protocol) if not hasattr(proposer, n))
    if missing:
        raise TypeError(f"{type(proposer).__name__} ({why}) lacks {', '.join(missing)} of the {protocol.__name__} "
                        "interface (inference/proposers/base.py)")
