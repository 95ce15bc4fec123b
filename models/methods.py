"""What a drafter is, and the one table of methods draftsmith trains, exports and serves.

A drafter is an nn.Module stating the protocol below. Every place that used to branch on the
method (training's build and objective, the predicted-acceptance walk, export, export.check,
the runtime proposer, checkpoints) reads the method's row of `METHODS` instead, so adding a
method is one model file, its export layout module and one row here (docs/design.md).

The row names its runtime proposer and its export layouts by module path, not by import:
`models` sits below `export` and `inference` in the layer order, and those packages resolve
the names themselves (`resolve`).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from models.dflash import DFlashConfig, DFlashDrafter, default_target_layer_ids
from models.eagle1 import Eagle1Config, Eagle1Drafter
from models.eagle3 import Eagle3Config, Eagle3Drafter
from models.medusa import MedusaConfig, MedusaDrafter
from models.mtp import MTPConfig, MTPDrafter


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
block: one forward per anchor drafts the whole block (DFlash)."""


@dataclass(frozen=True)
class Method:
    """One method: everything the code needs to know about it that its drafter does not say."""

    config: type  # the drafter's config dataclass (config.from_dict rebuilds it from a checkpoint)
    drafter: type  # the nn.Module, built as drafter(config)
    build: Callable  # (run config's drafter section, target hf_config, Vd, mask token id) → drafter
    proposer: str  # "module:callable", (drafter, k, batch, max_len, target_config) → runtime proposer
    layouts: dict  # export layout name → its module (write / reads / read / served_config); the first is the default
    predictor: str  # one of PREDICTORS
    joint: bool = False  # may train together with the target (objective.joint)
    feature_regression: bool = False  # predicts the target's features (objective.feature_weight)


def _eagle3(d, hf_config, vd: int, mask_token_id: int):
    return Eagle3Drafter(Eagle3Config.from_target(hf_config, vd, d.aux_layer_ids, norm_before_residual=d.norm_before_residual,
                                                  norm_before_fc=d.norm_before_fc))


def _eagle1(d, hf_config, vd: int, mask_token_id: int):
    return Eagle1Drafter(Eagle1Config.from_target(hf_config, vd, fc_bias=d.fc_bias))


def _medusa(d, hf_config, vd: int, mask_token_id: int):
    return MedusaDrafter(MedusaConfig.from_target(hf_config, vd, d.medusa_heads, d.medusa_layers))


def _mtp(d, hf_config, vd: int, mask_token_id: int):
    return MTPDrafter(MTPConfig.from_target(hf_config, vd, d.mtp_modules))


def _dflash(d, hf_config, vd: int, mask_token_id: int):
    layer_ids = d.aux_layer_ids or default_target_layer_ids(hf_config.num_hidden_layers, d.dflash_target_layers)
    return DFlashDrafter(DFlashConfig.from_target(hf_config, vd, mask_token_id, d.dflash_layers, d.dflash_block_size,
                                                  layer_ids))


METHODS: dict[str, Method] = {
    "eagle3": Method(Eagle3Config, Eagle3Drafter, _eagle3, "inference.proposers.drafters:Eagle3Proposer",
                     {"speculators": "export.speculators", "sglang": "export.sglang"}, "chain"),
    "eagle1": Method(Eagle1Config, Eagle1Drafter, _eagle1, "inference.proposers.drafters:Eagle3Proposer",
                     {"eagle": "export.eagle1", "eagle-vllm": "export.eagle1"}, "chain", feature_regression=True),
    "medusa": Method(MedusaConfig, MedusaDrafter, _medusa, "inference.proposers.drafters:medusa_proposer",
                     {"medusa": "export.medusa"}, "heads", joint=True),
    "mtp": Method(MTPConfig, MTPDrafter, _mtp, "inference.proposers.blocks:MTPCachedProposer",
                  {"mtp": "export.mtp"}, "chain", joint=True),
    "dflash": Method(DFlashConfig, DFlashDrafter, _dflash, "inference.proposers.blocks:DFlashCachedProposer",
                     {"dflash": "export.dflash", "speculators": "export.speculators"}, "block"),
}


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
