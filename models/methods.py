"""What a drafter is, and the one table of methods draftsmith trains, exports and serves.

A drafter is an nn.Module stating the protocol below. Every place that used to branch on the
method (training's build and objective, the run config's method section, the predicted-
acceptance walk, export, export.check, the runtime proposer, the bench and the tree gate,
checkpoints) reads the method's row of `METHODS` instead, so adding a method is one model file
(its drafter, its config and its run-config section, `options`), its export layout module and
one row, here or through `register` (docs/design.md).

The row names its runtime proposer and its export layouts by module path, not by import:
`models` sits below `export` and `inference` in the layer order, and those packages resolve
the names themselves (`resolve`).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from models import dflash, dspark, eagle1, eagle3, medusa, mtp
from models.dflash import DFlashConfig, DFlashDrafter, DFlashOptions
from models.dspark import DSparkConfig, DSparkDrafter, DSparkOptions
from models.eagle1 import Eagle1Config, Eagle1Drafter, Eagle1Options
from models.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Options
from models.medusa import MedusaConfig, MedusaDrafter, MedusaOptions
from models.mtp import MTPConfig, MTPDrafter, MTPOptions
from models.options import MethodOptions


@runtime_checkable
class Drafter(Protocol):
    """What training, prediction, export and serving call on every drafter."""

    config: Any  # its config dataclass (to_dict / from_dict: what checkpoints and exports store)
    aux_layer_ids: list[int]  # target layers it reads (output-of-layer ids); [] = the final hidden state
    d2t: torch.Tensor  # [Vd] buffer: target id of draft row r is r + d2t[r]
    t2d: torch.Tensor  # [V] bool buffer: which target ids are in the draft vocabulary

    def init_from_target(self, target_model, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Copy the maps and warm-start from the target (its embedding, head rows, ...)."""

    def draft_ids(self) -> torch.Tensor:
        """[Vd] target id of each draft-vocabulary row."""

    def features(self, target_out) -> torch.Tensor:
        """What it reads from a target pass (models.target.Target's output): [B,T,width]."""

    def train_steps(self, requested: int) -> int:
        """Drafts trained per position given the requested TTT length (heads: their count)."""


@runtime_checkable
class ChainDrafter(Drafter, Protocol):
    """Predictor kinds "chain" and "heads": k drafts per position in one unroll."""

    def unroll(self, input_ids, features, steps: int, position_ids=None, greedy: bool = False) -> list[torch.Tensor]:
        """Logits [B,T,Vd] of draft steps 0..steps-1 at every position; step s at index t
        drafts x_{t+2+s}. "chain" drafters also take `pick` (which token step s feeds on)."""


@runtime_checkable
class BlockDrafter(Drafter, Protocol):
    """Predictor kind "block": a whole block of drafts per anchor in one forward."""

    def block_logits(self, ids, features, anchors) -> torch.Tensor:
        """[R,m,B,Vd] logits of every block position at anchors [R,m]."""

    def draft_at(self, ids, features, anchors, k: int) -> torch.Tensor:
        """[m,k] greedy drafts (target ids) of the blocks at anchors [m] of one row."""

    def position_weights(self) -> list[float]:
        """Loss weight of each block position."""


PREDICTORS = ("chain", "heads", "block")
"""chain: step s reads draft s-1 (EAGLE, MTP); heads: steps read no drafted token (Medusa);
block: one forward per anchor drafts the whole block (DFlash; DSpark then adds a bias per draft,
left to right, from the draft before it)."""


@dataclass(frozen=True)
class Method:
    """One method: everything the code needs to know about it that its drafter does not say."""

    config: type  # the drafter's config dataclass (config.from_dict rebuilds it from a checkpoint)
    drafter: type  # the nn.Module, built as drafter(config)
    build: Callable  # (run config's drafter section, target hf_config, Vd, default mask token id) → drafter
    proposer: str  # "module:callable", (drafter, k, batch, max_len, target_config) → runtime proposer
    layouts: dict  # export layout name → its module (write / reads / read / served_config); the first is the default
    predictor: str  # one of PREDICTORS
    joint: bool = False  # may train together with the target (objective.joint)
    feature_regression: bool = False  # predicts the target's features (objective.feature_weight)
    options: type | None = None
    """Its section of the run config, `drafter.<name>` (a MethodOptions dataclass: fields, ranges,
    checks; models/options.py); None: the method has no fields of its own."""
    display_name: str = ""  # how reports and the bench name it (default: the method's name)
    trees: bool = False  # drafts EAGLE-2 trees (inference/tree/loop.py: EagleTreeProposer, eval.trees, --tree)
    max_drafts: Callable | None = None  # (drafter config) → most drafts per step, or None: any k


METHODS: dict[str, Method] = {
    "eagle3": Method(Eagle3Config, Eagle3Drafter, eagle3.build, "inference.proposers.drafters:Eagle3Proposer",
                     {"speculators": "export.speculators", "sglang": "export.sglang"}, "chain",
                     options=Eagle3Options, display_name="EAGLE-3", trees=True),
    "eagle1": Method(Eagle1Config, Eagle1Drafter, eagle1.build, "inference.proposers.drafters:Eagle3Proposer",
                     {"eagle": "export.eagle1", "eagle-vllm": "export.eagle1"}, "chain", feature_regression=True,
                     options=Eagle1Options, display_name="EAGLE-1"),
    "medusa": Method(MedusaConfig, MedusaDrafter, medusa.build, "inference.proposers.drafters:medusa_proposer",
                     {"medusa": "export.medusa"}, "heads", joint=True, options=MedusaOptions, display_name="Medusa",
                     max_drafts=lambda c: c.num_heads),
    "mtp": Method(MTPConfig, MTPDrafter, mtp.build, "inference.proposers.blocks:MTPCachedProposer",
                  {"mtp": "export.mtp"}, "chain", joint=True, options=MTPOptions, display_name="MTP",
                  max_drafts=lambda c: c.num_modules),
    "dflash": Method(DFlashConfig, DFlashDrafter, dflash.build, "inference.proposers.blocks:DFlashCachedProposer",
                     {"dflash": "export.dflash", "speculators": "export.speculators"}, "block", options=DFlashOptions,
                     display_name="DFlash", max_drafts=lambda c: c.block_size - 1),
    # DFlash's backbone plus a Markov head and a confidence head (models/dspark.py); its drafts
    # read the draft before them, so its walks call the drafter's draft_at / drive_block
    "dspark": Method(DSparkConfig, DSparkDrafter, dspark.build, "inference.proposers.dspark:DSparkCachedProposer",
                     {"dspark": "export.dspark", "speculators": "export.dspark"}, "block", options=DSparkOptions,
                     display_name="DSpark", max_drafts=lambda c: c.block_size - 1),
}


def register(name: str, row: Method) -> Method:
    """Add method `name` to the table (a plugin's or a test's method: nothing else to edit);
    a ValueError when the name is taken or the row is not one the code can use."""
    import dataclasses

    if name in METHODS:
        raise ValueError(f"method {name!r} is already in the table")
    if not name.isidentifier():
        raise ValueError(f"method name {name!r} must be an identifier (it is the key of its run-config section)")
    if row.predictor not in PREDICTORS:
        raise ValueError(f"method {name!r}: predictor {row.predictor!r} is not one of {', '.join(PREDICTORS)}")
    if row.options is not None and not (dataclasses.is_dataclass(row.options) and issubclass(row.options, MethodOptions)):
        raise ValueError(f"method {name!r}: options must be a MethodOptions dataclass (models/options.py)")
    if not row.layouts:
        raise ValueError(f"method {name!r}: give at least one export layout")
    METHODS[name] = row
    return row


def method(name: str) -> Method:
    """The row of `name`; a ValueError naming the known methods otherwise."""
    if name not in METHODS:
        raise ValueError(f"unknown drafter method {name!r} (known: {', '.join(METHODS)})")
    return METHODS[name]


def method_name_of(drafter) -> str:
    """The method whose drafter class `drafter` is (its exact class first, then a base class)."""
    for name, row in METHODS.items():
        if type(drafter) is row.drafter:
            return name
    for name, row in METHODS.items():
        if isinstance(drafter, row.drafter):
            return name
    raise ValueError(f"{type(drafter).__name__} is the drafter of no method in models/methods.py "
                     f"(known: {', '.join(METHODS)})")


def method_of(drafter) -> Method:
    return METHODS[method_name_of(drafter)]


def resolve(path: str):
    """The object a row names as "module:attribute" (or a module, given without a colon)."""
    module, _, attr = path.partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, attr) if attr else mod


def default_layout(name: str) -> str:
    """The layout a training run of method `name` exports to (its row's first)."""
    return next(iter(method(name).layouts))


def predictor_of(drafter) -> str:
    """The predictor kind of `drafter`: its method's; a drafter of no method (a test's scripted
    one) is taken as a chain drafter, which needs `unroll` alone."""
    try:
        return method_of(drafter).predictor
    except ValueError:
        return "chain"


def display_name(drafter) -> str:
    """How reports and the bench name `drafter`'s method (its row's display_name, else the
    method's name; a drafter of no method: its class name)."""
    try:
        name = method_name_of(drafter)
    except ValueError:
        return type(drafter).__name__.removesuffix("Drafter")
    return METHODS[name].display_name or name


def max_drafts(drafter) -> int | None:
    """The most drafts `drafter` makes per step (Medusa: its heads, MTP: its modules, DFlash:
    B - 1), or None where any k is fine (its row's max_drafts)."""
    try:
        row = method_of(drafter)
    except ValueError:
        return None
    return row.max_drafts(drafter.config) if row.max_drafts is not None else None


def drafts_trees(drafter) -> bool:
    """Whether `drafter`'s method drafts EAGLE-2 trees (its row's `trees`)."""
    try:
        return method_of(drafter).trees
    except ValueError:
        return False


def check_tree_drafter(drafter):
    """Trees are drafted by the methods whose row says `trees` (EAGLE-3: `EagleTreeProposer`);
    say so in one line otherwise."""
    if not drafts_trees(drafter):
        able = ", ".join(row.display_name or name for name, row in METHODS.items() if row.trees)
        raise ValueError(f"draft trees are drafted by {able} drafters for now (EAGLE-1 and the others draft chains), "
                         f"not by this {display_name(drafter)} drafter")
