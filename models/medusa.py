"""Medusa drafter: K heads on the target's last hidden state, each `m` residual blocks then a
head over the draft vocabulary.

Shapes: B batch, T positions, H the target's hidden size, Vd draft vocab, K heads.

Alignment (shared with every drafter here): head s (0-based) at position t reads the
target's final normed hidden state h_t, which the target's own head turns into x_{t+1}, and
predicts x_{t+2+s}. So a chain from the last verified position is one draft per head, and
"unrolling" Medusa is applying its heads: they read no drafted token, which is why their
acceptance falls faster with depth than EAGLE's.

Parameter names follow vLLM's `MedusaModel` (blocks.{i}.layers.{j}, lm_heads.{i}), so the
state dict exports without renaming (docs/formats.md). Residual blocks start at zero (weights and
biases), so each head starts as the target's own head restricted to the draft vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from models.draft_vocab import check_draft_vocab, draft_ids, register_maps
from models.layers import DictConfig
from models.options import MethodOptions, non_negative_int, positive_int


@dataclass
class MedusaConfig(DictConfig):
    vocab_size: int  # V
    draft_vocab_size: int  # Vd
    hidden_size: int  # H (the target's)
    target_num_layers: int
    num_heads: int = 4  # K
    num_layers: int = 1  # m residual blocks per head
    layer_id_convention: str = "output_of_layer"

    def __post_init__(self):
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError(f"Medusa needs at least one head and a non-negative block count, got {self.num_heads}, {self.num_layers}")
        check_draft_vocab(self.draft_vocab_size, self.vocab_size)

    @classmethod
    def from_target(cls, hf_config, draft_vocab_size: int, num_heads: int = 4, num_layers: int = 1) -> "MedusaConfig":
        return cls(vocab_size=hf_config.vocab_size, draft_vocab_size=draft_vocab_size, hidden_size=hf_config.hidden_size,
                   target_num_layers=hf_config.num_hidden_layers, num_heads=num_heads, num_layers=num_layers)


@dataclass
class MedusaOptions(MethodOptions):
    """The run config's `drafter.medusa` section."""

    heads: int = 4
    """K heads; head k (1-based) predicts the token k+1 positions after the last verified one."""
    layers: int = 1
    """Residual blocks per head."""

    RANGES: ClassVar[tuple] = (("heads", positive_int, "a positive integer"),
                               ("layers", non_negative_int, "a non-negative integer"))
    RENAMED: ClassVar[dict] = {"medusa_heads": "heads", "medusa_layers": "layers"}

    def problems(self, run, key: str) -> list[str]:
        if run.eval.k > self.heads:
            return [f"eval.k: {run.eval.k} drafts need {run.eval.k} Medusa heads; {key}.heads is {self.heads}"]
        return []


def build(d, hf_config, vd: int, mask_token_id: int) -> "MedusaDrafter":
    """The drafter of run-config drafter section `d` (its `options`: MedusaOptions) for this target."""
    return MedusaDrafter(MedusaConfig.from_target(hf_config, vd, d.options.heads, d.options.layers))


class ResidualBlocks(nn.Module):
    """x + SiLU(Linear(x)), `m` times; zero-initialised, so it starts as the identity."""

    def __init__(self, hidden: int, m: int):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(hidden, hidden, bias=True) for _ in range(m)])
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x):
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaDrafter(nn.Module):
    aux_layer_ids: list[int] = []  # reads the target's final hidden state only

    def __init__(self, cfg: MedusaConfig):
        super().__init__()
        self.config = cfg
        self.blocks = nn.ModuleList([ResidualBlocks(cfg.hidden_size, cfg.num_layers) for _ in range(cfg.num_heads)])
        self.lm_heads = nn.ModuleList([nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False) for _ in range(cfg.num_heads)])
        register_maps(self, cfg)

    @torch.no_grad()
    def init_from_target(self, target_model, d2t: torch.Tensor, t2d: torch.Tensor):
        """Every head starts from the target's head rows of the draft vocabulary."""
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        rows = target_model.get_output_embeddings().weight[self.draft_ids()]
        for head in self.lm_heads:
            head.weight.copy_(rows)

    def draft_ids(self) -> torch.Tensor:
        """[Vd] target id of each draft-vocab row."""
        return draft_ids(self.d2t)

    def features(self, target_out) -> torch.Tensor:
        """What the heads read from a target pass: its final normed hidden state [B,T,H]."""
        return target_out.last_hidden

    def train_steps(self, requested: int) -> int:
        return self.config.num_heads  # every head is trained, whatever the TTT setting

    def unroll(self, input_ids, hidden, steps: int, position_ids=None, greedy: bool = False):
        """Logits of heads 0..steps-1 at every position: a list of [B,T,Vd]. `input_ids` and
        `greedy` are accepted for the common drafter interface: heads read no tokens."""
        if steps > self.config.num_heads:
            raise ValueError(f"a chain of {steps} drafts needs {steps} Medusa heads; this drafter has {self.config.num_heads}")
        hidden = hidden.to(self.lm_heads[0].weight.dtype)
        return [self.lm_heads[s](self.blocks[s](hidden)) for s in range(steps)]
