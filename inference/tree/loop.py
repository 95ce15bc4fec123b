"""The EAGLE-3 tree proposer: an EAGLE-3 drafter drafts an EAGLE-2 dynamic tree, depth by depth,
for the device loop (inference/tree/plan.py: the step's launches in order, `TreeLoop`), and the
same functions draft training's held-out walk trees (inference/walks/tree.py).

Shapes: B rows, N tree nodes (`total_tokens`), D depth, K nodes kept per depth (`top_k`, also
the root's children), k children drafted per kept node below depth 1 (`children`, K by default),
C = K + (D-1) K k candidates drafted, S cache slots, H hidden, Vd draft vocabulary.

Positions and slots: the root (the row's last verified token) sits at position and slot
base = length - 1; node i is fed at position base + depth(i) and written at slot base + 1 + i
until the accepted path's moves put it at slots base + 1 .. base + L. The drafter keeps its own
cache exactly as for chains (EAGLE's step-0 entries, one position behind the target), and its
tree nodes' K/V in a per-step candidate buffer; after verification it takes in the accepted
path like a chain of the same length (`Eagle3Proposer.advance`).

The drafter's tree steps run through the runtime's kernels on a GPU (the tree-attention kernel
over its cache and its candidate buffer, the fused norms and SwiGLU of chains; each depth's
selection inside its head's merge and the next step's paired input norms: `_expand`), the torch
references elsewhere, bit for bit the same.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith_kernels.dispatch import use_kernel
from draftsmith_kernels.lm_head_topk import norm_lm_head_topk_reference
from draftsmith_kernels.rms_norm import rms_norm, rms_norm_pair
from draftsmith_kernels.rope_cache import rope_cache
from draftsmith_kernels.silu_mul import swiglu_into
from draftsmith_kernels.tree_attention import tree_attention
from draftsmith_kernels.tree_select import Candidates, expand_children_triton, frontier_norm_pair_triton
from inference.proposers.drafters import Eagle3Proposer
from inference.tree.ops import Tree, expand_level_reference
from inference.tree.plan import rerank


class EagleTreeProposer(Eagle3Proposer):
    """EAGLE-2 dynamic trees from an EAGLE-3 drafter: `depth` levels, the `top_k` best frontier
    nodes expanded into `children` children each (`top_k` unless given; the root into `top_k`),
    the best `total_tokens` candidates kept (by cumulative draft log-probability; parents always
    before children)."""

    tree = True
    # TreeLoop (inference/tree/plan.py) reranks `draft_candidates` itself, with the verify's input
    # and the last verify's cache moves as epilogues, and hands `advance` the next input its
    # accept launch made
    feeds_verify = True

    def __init__(self, drafter, depth: int, top_k: int, total_tokens: int, batch: int, max_len: int, target_config=None,
                 children: int | None = None):
        super().__init__(drafter, depth, batch, max_len, target_config)
        from models.methods import check_tree_drafter

        check_tree_drafter(drafter)  # the method table's `trees` says which drafters draft trees
        children = top_k if children is None else children
        candidates = tree_candidate_count(depth, top_k, children)
        if depth < 1 or top_k < 1 or children < 1 or not 1 <= total_tokens <= candidates:
            raise ValueError(f"a tree of depth {depth} expanding top_k={top_k} nodes into {children} children drafts "
                             f"{candidates} candidates: total_tokens={total_tokens} must be in 1..{candidates} (and "
                             f"depth, top_k, children >= 1)")
        self.top_k, self.children, self.total_tokens, self.candidates = top_k, children, total_tokens, candidates
        self.verify_tokens = total_tokens  # the verify step feeds the root and these nodes
        # the candidates' K and V [2,B,nkv,C,d], written level by level. No node sees a slot not
        # written this draft (its mask row holds its ancestors and itself); the tree kernel reads
        # only slots some query sees, but the torch path multiplies the others' values by weight
        # 0 (an earlier draft's inf there would make NaN of every later draft): it zeroes the
        # buffer first.
        B, nkv, _, head_dim = self.k_cache.shape
        self.cand_kv = self.k_cache.new_zeros(2, B, nkv, candidates, head_dim)

    @torch.no_grad()
    def draft_candidates(self) -> Candidates:
        """Every candidate of the tree below each row's root, depth by depth (the plan's launches
        1-4): Candidates [B,C], read by the rerank."""
        return draft_candidates(self, self.hidden, self.last, self.k_cache, self.v_cache, self.k, self.top_k,
                                cand_kv=self.cand_kv if use_kernel(self.cand_kv) else self.cand_kv.zero_(),
                                children=self.children)

    @torch.no_grad()
    def draft_tree(self) -> Tree:
        """The tree below each row's root (inference/tree/ops.py: Tree, positions last + 1 + depth),
        in new tensors: the candidates, then the rerank without the loop's epilogues."""
        return rerank(self.draft_candidates(), self.children, self.top_k, self.total_tokens, self.last)


def tree_candidate_count(depth: int, top_k: int, children: int | None = None) -> int:
    """Candidates an EAGLE-2 tree drafts: top_k at depth 1, top_k x children (top_k unless
    given) at every later depth."""
    return top_k + (depth - 1) * top_k * (top_k if children is None else children)


@torch.no_grad()
def draft_eagle_tree(p: Eagle3Proposer, hidden, last, k_cache, v_cache, depth: int, top_k: int, total_tokens: int,
                     out: Tree | None = None, cand_kv: torch.Tensor | None = None, children: int | None = None) -> Tree:
    """EAGLE-2 selection with an EAGLE-3 drafter `p`: `draft_candidates`, then the rerank
    (inference/tree/plan.py `rerank`) → Tree (inference/tree/ops.py), positions last + 1 + depth
    (into `out`'s tensors when given). The runtime's loop launches the same two with the rerank's
    epilogues; training's held-out walk (inference/walks/tree.py) calls this on the entries of a
    whole text, one row per anchor, so both draft the very same trees."""
    children = top_k if children is None else children
    cand = draft_candidates(p, hidden, last, k_cache, v_cache, depth, top_k, cand_kv, children)
    return rerank(cand, children, top_k, total_tokens, last, out)


@torch.no_grad()
def draft_candidates(p: Eagle3Proposer, hidden, last, k_cache, v_cache, depth: int, top_k: int,
                     cand_kv: torch.Tensor | None = None, children: int | None = None) -> Candidates:
    """Every candidate of an EAGLE-2 tree, depth by depth, with an EAGLE-3 drafter `p` (its
    weights; its own state is not read): hidden [B,H] the drafter's output at each row's last
    step-0 entry, last [B] that entry's position, k_cache / v_cache [B,nkv,S,d] its step-0 entries
    (read up to `last` only, never written). cand_kv: zeros [2,B,nkv,C,d] for the candidates' K
    and V (new ones when None). children: what each frontier node below the root is expanded
    into (top_k when None: EAGLE-2's square tree). → Candidates [B,C]."""
    d = p.drafter
    B = hidden.shape[0]
    cfg = d.config
    children = top_k if children is None else children
    candidates = tree_candidate_count(depth, top_k, children)
    if cand_kv is None:
        cand_kv = k_cache.new_zeros(2, B, cfg.num_key_value_heads, candidates, cfg.head_dim)
    cand_k, cand_v = cand_kv.unbind()
    # [B,F,H]: the drafter's output at the frontier just drafted from (the root alone first); a
    # new frontier node's parent is one of its rows (Frontier.parent_row)
    drafted_from = hidden[:, None]
    # every candidate's token, parent, score and ancestors, depth by depth
    cand = Candidates.empty(B, candidates, hidden.device)
    index = scores = None  # the frontier: the root alone
    k, drafted = top_k, 0  # the root's children: top_k
    for level in range(depth):
        more = level + 1 < depth  # the drafter runs on the new frontier (its nodes are at depth level + 1)
        frontier, pair, parent_hidden = _expand(p, drafted_from, k, index, scores, drafted, level, last, cand, top_k,
                                                more)
        drafted += drafted_from.shape[1] * k
        if more:
            h = _tree_step(p, pair, parent_hidden, frontier, cand_k, cand_v, k_cache, v_cache, last)
            drafted_from = h.to(hidden.dtype)
            index, scores, k = frontier.index, frontier.scores, children
    assert drafted == candidates  # every candidate slot written: the rerank reads them all
    return cand


def _expand(p: Eagle3Proposer, drafted_from, k: int, index, scores, off: int, level: int, last, cand: Candidates,
            top_k: int, more: bool):
    """One depth of EAGLE-2 selection: the drafter's head over drafted_from [B,F,H] (the outputs at
    the frontier index / scores [B,F], None: the root), each node's best k children written as
    candidates off .. off + F k of `cand`; when the drafter runs on a deeper level (`more`), the
    next frontier (the best top_k of them) and that layer's input: its two normalised halves
    [B,top_k,2H] (token embeddings, parents' hidden states) and the parents' hidden states
    [B,top_k,H] (the residual). → (Frontier, pair, parent_hidden), or three Nones.

    On a GPU three launches (two at the last depth; inference/tree/plan.py's head, merge and
    frontier): the head's slices, their merge writing the candidates (its epilogue), then the
    frontier ranked beside the layer's input norms (kernels/tree_select.py); elsewhere the torch
    references (the head's, `expand_level_reference`, `rms_norm_pair`), the same bits."""
    d = p.drafter
    layer = d.layers[0]
    B, _, H = drafted_from.shape
    parent_hidden = drafted_from.new_empty(B, top_k, H) if more else None
    # the state the next layer reads: EAGLE-3.1's norm_output feeds the final-normed one (drafter.fed_back)
    fed = drafted_from
    if more and getattr(d.config, "norm_output", False):
        fed = rms_norm(drafted_from, d.norm.weight, d.norm.eps)[0]
    norms = (d.embed_tokens.weight, layer.input_layernorm.weight, fed, layer.hidden_norm.weight, layer.hidden_norm.eps)
    if use_kernel(drafted_from):
        expand_children_triton(drafted_from, d.norm.weight, d.norm.eps, d.lm_head.weight, k, p.draft_ids, index, scores,
                               off, cand)
        if not more:
            return None, None, None
        frontier, pair = frontier_norm_pair_triton(cand, off, k, top_k, level, last, *norms, parent_hidden)
        return frontier, pair, parent_hidden
    child_logprobs, child_ids = _draft_top_k(d, drafted_from, k)  # [B,F,k]: log-probabilities, draft-vocabulary rows
    frontier = expand_level_reference(child_ids, child_logprobs, p.draft_ids, index, scores, off, level, last, cand,
                                      top_k)
    if not more:
        return None, None, None
    table, table_weight, x, x_weight, eps = norms
    pair = rms_norm_pair(table, frontier.tokens, table_weight, x, x_weight, eps, x_rows=frontier.parent_row,
                         x_out=parent_hidden)
    return frontier, pair, parent_hidden


def _tree_step(p: Eagle3Proposer, pair, parent_hidden, frontier, cand_k, cand_v, k_cache, v_cache, last):
    """EAGLE-3's layer (as `_eagle3_layer`) for the F frontier nodes, from their input pair [B,F,2H]
    and their parents' hidden states parent_hidden [B,F,H] (`_expand`): frontier.positions, index
    [B,F], visible [B,F,C] (each node's ancestors and itself). Their K/V go to the candidate
    buffers [B,nkv,C,d] at their candidate index; each node attends to the drafter's cache
    [B,nkv,S,d] up to the row's last step-0 entry `last` [B] and to the visible candidates.
    → hidden [B,F,H]."""
    d = p.drafter
    layer, cfg = d.layers[0], d.config
    H = parent_hidden.shape[-1]
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    # q rotated; k rotated and v written to the candidate buffers at the nodes' candidate indices
    # (one launch on a GPU: kernels/rope_cache.py, its slots being the candidate indices)
    q = rope_cache(F.linear(pair, p.qkv_weight), frontier.positions, d.inv_freq, cand_k, cand_v, nh, nkv,
                   slots=frontier.index)
    attn = layer.self_attn.o_proj(tree_attention(q, k_cache, v_cache, last, cand_k, cand_v, frontier.visible))
    residual = pair[..., H:] if layer.norm_before_residual else parent_hidden
    post, h = rms_norm(attn, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps, residual)
    return swiglu_into(h, post, p.gate_up_weight, layer.mlp.down_proj)  # h + MLP(post)


def _draft_top_k(d, hidden, top_k: int):
    """hidden [B,F,H] → (log-probabilities, draft-vocabulary rows) [B,F,top_k] of each node's
    best children, best first, ties to the lowest row: the final norm, lm_head, log-softmax and
    top-k in torch (kernels/lm_head_topk.py's reference; on a GPU `_expand` runs the head's
    kernels)."""
    return norm_lm_head_topk_reference(hidden, d.norm.weight, d.norm.eps, d.lm_head.weight, top_k)
