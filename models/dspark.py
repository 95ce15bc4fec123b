"""DSpark drafter: the DFlash backbone (models/dflash.py, one non-causal forward drafts a block
from the target's fused features) plus two small heads, as vLLM 0.33 serves `dspark`
(vllm/model_executor/models/qwen3_dspark.py) and speculators 0.9.0 trains it.

Parameters beyond DFlashDrafter's (names as vLLM's checkpoint names them, so the export is an
identity map; V target vocab, Vd draft vocab, H hidden, r = config.markov_rank):

    markov_head.markov_w1.weight   [V, r]      embedding of the previous token (a TARGET id)
    markov_head.markov_w2.weight   [Vd, r]     projection of that embedding to a draft-vocab bias
    confidence_head.proj.weight    [1, H + r]  (H alone when confidence_with_markov is off)
    confidence_head.proj.bias      [1]

(only with config.confidence_head). Every DFlash parameter keeps its name (fc, hidden_norm,
layers.*, norm, embed_tokens, lm_head; d2t / t2d buffers).

Alignment: DFlash's, vLLM's `sample_from_anchor = false` (the anchor x_{a+1} is the bonus
token, block positions 1..B-1 draft; SAMPLE_FROM_ANCHOR below, which the export writes).
Block position j drafts x_{a+1+j}; its Markov "previous token" is the token before it:
x_{a+1} (the bonus) for j = 1, draft j-1 for j > 1. Its logits are

    logits_j = lm_head(h_j) + markov_w2(markov_w1[prev_j])       h_j: the final-normed hidden state
    confidence_j = sigmoid(proj([h_j ; markov_w1[prev_j]]))       P(draft j accepted | drafts < j were)

Drafting (the walk; greedy and sampled) runs the backbone once, then left to right: position
j's bias needs draft j-1. Training forces the text instead (prev_j = x_{a+j}, the verified
token), so `block_logits` stays one forward.

The API the runtime and the walks call:

    markov_walk(hidden [m,k,H], first [m], pick=None) -> (tokens [m,k], confidence [m,k] | None)
        the left-to-right stage on backbone hidden states of block positions 1..k (final-normed,
        what lm_head reads); first: the bonus tokens x_{a+1} (target ids). pick(logits [m,Vd], j)
        -> tokens [m] (target ids) chooses draft j+1 (0-based j); None: greedy, the draft row's
        argmax mapped to its target id. tokens are target ids; confidence: sigmoid probabilities
        (None without a confidence head).
    draft_block(ids [T], features [T,n*H], anchors [m], k, pick=None) -> (tokens [m,k], confidence)
        block_hidden at the anchors, then markov_walk (what training's walk drafts with).
    draft_at(ids, features, anchors, k) -> tokens [m,k]          greedy (inference.walks.greedy)
    drive_block(ids, features, anchors, k, step) -> confidence   sampled (inference.walks.sampled)
    block_outputs(ids, features, anchors) -> (logits [R,m,B,Vd], confidence logits [R,m,B] | None)
        teacher-forced, one forward (training's objective)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from models.dflash import DFlashConfig, DFlashDrafter, DFlashOptions, default_target_layer_ids
from models.layers import DecoderShape
from models.options import non_negative, positive_int

SAMPLE_FROM_ANCHOR = False  # DFlash's alignment: the anchor is the bonus token, B-1 drafts per block
CONFIDENCE_TARGETS = ("overlap", "greedy")
"""What the confidence head learns of position j, given drafts < j accepted (the text before it):
overlap = sum_x min(p_j(x), q_j(x)), the acceptance probability of standard verification at T = 1
(the reference trainer's target; the sampled walk's alpha_j); greedy = 1 if the draft row's
argmax is the target's argmax (acceptance at T = 0, the greedy walk's)."""


@dataclass(kw_only=True)
class DSparkConfig(DFlashConfig):
    markov_rank: int = 256  # r, as the served checkpoints and the reference trainer use
    confidence_head: bool = True  # vLLM: enable_confidence_head
    confidence_with_markov: bool = True  # vLLM: confidence_head_with_markov (the head reads [h ; markov_w1[prev]])
    # training only (no server reads them; checkpoints record how the heads were trained)
    confidence_weight: float = 1.0  # weight of the confidence BCE against the token loss
    confidence_target: str = "overlap"  # one of CONFIDENCE_TARGETS

    def __post_init__(self):
        if not (isinstance(self.markov_rank, int) and self.markov_rank > 0):
            raise ValueError(f"markov_rank {self.markov_rank!r} must be a positive integer")
        if self.confidence_target not in CONFIDENCE_TARGETS:
            raise ValueError(f"confidence_target {self.confidence_target!r} must be one of {', '.join(CONFIDENCE_TARGETS)}")
        super().__post_init__()

    @classmethod
    def from_target(cls, hf_config, draft_vocab_size: int, mask_token_id: int, num_layers: int = 5, block_size: int = 8,
                    target_layer_ids: list[int] | None = None, **dspark) -> "DSparkConfig":
        """The target's decoder shape, DFlash's fields and DSpark's own (`dspark`: markov_rank, ...)."""
        return DecoderShape.from_target.__func__(cls, hf_config, draft_vocab_size, mask_token_id=mask_token_id,
                                                 target_layer_ids=list(target_layer_ids or []), num_layers=num_layers,
                                                 block_size=block_size, **dspark)


@dataclass
class DSparkOptions(DFlashOptions):
    """The run config's `drafter.dspark` section: DFlash's fields plus the heads'."""

    markov_rank: int = 256
    """Rank r of the Markov head (markov_w1 [V, r], markov_w2 [Vd, r]); 256 as served checkpoints."""
    confidence_head: bool = True
    """Train the confidence head (adaptive verification reads it)."""
    confidence_with_markov: bool = True
    """The confidence head reads the Markov embedding of the previous token with the hidden state."""
    confidence_weight: float = 1.0
    """Weight of the confidence head's BCE in the loss (speculators' confidence_head_alpha)."""
    confidence_target: str = "overlap"
    """What the confidence head learns: overlap (acceptance at T = 1, sum min(p, q)) or greedy (at T = 0)."""

    RANGES: ClassVar[tuple] = DFlashOptions.RANGES + (
        ("markov_rank", positive_int, "a positive integer"),
        ("confidence_head", lambda v: isinstance(v, bool), "true or false"),
        ("confidence_with_markov", lambda v: isinstance(v, bool), "true or false"),
        ("confidence_weight", non_negative, "a number >= 0"),
        ("confidence_target", lambda v: v in CONFIDENCE_TARGETS, f"one of {', '.join(CONFIDENCE_TARGETS)}"))
    RENAMED: ClassVar[dict] = {}  # DFlash's flat keys stay DFlash's


def build(d, hf_config, vd: int, mask_token_id: int) -> "DSparkDrafter":
    """The drafter of run-config drafter section `d` (its `options`: DSparkOptions)."""
    o = d.options
    layer_ids = d.aux_layer_ids or default_target_layer_ids(hf_config.num_hidden_layers, o.target_layers)
    mask = o.mask_token_id if o.mask_token_id is not None else mask_token_id
    return DSparkDrafter(DSparkConfig.from_target(
        hf_config, vd, mask, o.layers, o.block_size, layer_ids, markov_rank=o.markov_rank,
        confidence_head=o.confidence_head, confidence_with_markov=o.confidence_with_markov,
        confidence_weight=float(o.confidence_weight), confidence_target=o.confidence_target))


class DSparkMarkovHead(nn.Module):
    """Low-rank transition bias: markov_w2(markov_w1[prev]) [.., Vd] for previous tokens prev [..]."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        # small embedding, zero projection: a new drafter drafts exactly as its DFlash backbone,
        # and w2's gradient (through the nonzero embedding) starts the bias at once
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        nn.init.zeros_(self.markov_w2.weight)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [..] target ids → [.., r]."""
        return self.markov_w1(prev)

    def bias(self, embedding: torch.Tensor) -> torch.Tensor:
        """[.., r] → [.., Vd]."""
        return self.markov_w2(embedding.to(self.markov_w2.weight.dtype))


class DSparkConfidenceHead(nn.Module):
    """One logit per position from the hidden state (and the Markov embedding): proj [1, H (+ r)]."""

    def __init__(self, hidden_size: int, rank: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (rank if with_markov else 0), 1, bias=True)

    def forward(self, hidden: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        """hidden [.., H], embedding [.., r] → logits [..] (float32, as vLLM computes them)."""
        x = torch.cat([hidden, embedding.to(hidden.dtype)], -1) if self.with_markov else hidden
        return nn.functional.linear(x.float(), self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    def __init__(self, cfg: DSparkConfig):
        super().__init__(cfg)
        self.markov_head = DSparkMarkovHead(cfg.vocab_size, cfg.draft_vocab_size, cfg.markov_rank)
        self.confidence_head = (DSparkConfidenceHead(cfg.hidden_size, cfg.markov_rank, cfg.confidence_with_markov)
                                if cfg.confidence_head else None)

    # ------------------------------------------------------------------ teacher-forced (training)
    @staticmethod
    def forced_previous(ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
        """The previous token of every block position under teacher forcing: x_{a+j} for position
        j >= 1 (x_{a+1}, the bonus, for j = 1), x_{a+1} for position 0 (which drafts nothing).
        ids [R,T], anchors [R,m] → [R,m,B] target ids (clamped inside the row: positions past
        its end are out of every loss)."""
        j = torch.arange(block_size, device=ids.device).clamp_min(1)
        at = (anchors[:, :, None] + j).clamp_max(ids.shape[1] - 1)  # [R,m,B]
        return ids.gather(1, at.flatten(1)).view_as(at)

    def block_outputs(self, ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor):
        """Teacher-forced logits with the Markov bias [R,m,B,Vd] and confidence logits [R,m,B]
        (None without the head), one backbone forward; shapes as block_logits (one row: ids [T],
        anchors [m] → [m,B,Vd], [m,B])."""
        if ids.dim() == 1:
            logits, conf = self.block_outputs(ids[None], features[None], anchors[None])
            return logits[0], (None if conf is None else conf[0])
        hidden = self.block_hidden(ids, features, anchors)  # [R,m,B,H]
        embedding = self.markov_head.embed(self.forced_previous(ids, anchors, self.config.block_size))  # [R,m,B,r]
        logits = self.lm_head(hidden) + self.markov_head.bias(embedding)
        conf = self.confidence_head(hidden, embedding) if self.confidence_head is not None else None
        return logits, conf

    def block_logits(self, ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """DFlash's block_logits with the Markov bias of the forced previous tokens (the text's)."""
        return self.block_outputs(ids, features, anchors)[0]

    # ------------------------------------------------------------------ drafting (the walk)
    def markov_walk(self, hidden: torch.Tensor, first: torch.Tensor, pick=None):
        """The left-to-right stage: hidden [m,k,H] of block positions 1..k, first [m] the bonus
        tokens → (tokens [m,k] target ids, confidence [m,k] probabilities or None). pick(logits
        [m,Vd], j) → [m] target ids draws draft j+1; None: greedy."""
        draft_ids = self.draft_ids()
        base = self.lm_head(hidden)  # [m,k,Vd], one matmul for every position (as vLLM)
        prev, tokens, embeddings = first, [], []
        for j in range(hidden.shape[1]):
            embedding = self.markov_head.embed(prev)  # [m,r]
            logits = base[:, j] + self.markov_head.bias(embedding)
            prev = draft_ids[logits.argmax(-1)] if pick is None else pick(logits, j)
            tokens.append(prev)
            embeddings.append(embedding)
        conf = None
        if self.confidence_head is not None:
            conf = torch.sigmoid(self.confidence_head(hidden, torch.stack(embeddings, 1)))
        return torch.stack(tokens, 1), conf

    def draft_block(self, ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor, k: int, pick=None):
        """Drafts 1..k of the blocks at anchors [m] of one row (ids [T], features [T,n*H]) →
        (tokens [m,k] target ids, confidence [m,k] or None); pick as in markov_walk."""
        if k > self.config.block_size - 1:
            raise ValueError(f"a block of {self.config.block_size} drafts at most {self.config.block_size - 1} tokens, not {k}")
        hidden = self.block_hidden(ids, features, anchors)[:, 1 : k + 1]
        return self.markov_walk(hidden, ids[anchors + 1], pick)

    def draft_at(self, ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor, k: int) -> torch.Tensor:
        """Greedy drafts [m,k] (target ids), each position's bias from the draft before it."""
        return self.draft_block(ids, features, anchors, k)[0]

    def drive_block(self, ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor, k: int, step):
        """The sampled walk: step(logits [m,Vd]) → tokens [m] for drafts 1..k in order, each
        token fed to the next position's bias → the drafts' confidences [m,k] (None without the
        head; adaptive verification's walks read them)."""
        return self.draft_block(ids, features, anchors, k, pick=lambda logits, j: step(logits))[1]


def survival(confidence: torch.Tensor) -> torch.Tensor:
    """P(drafts 1..i all accepted) as the confidence head predicts it: the cumulative product of
    confidence [m,k] along each block → [m,k] (what adaptive verification spends its budget by)."""
    return confidence.cumprod(-1)
