"""Draft trees in the device loop: an EAGLE-3 drafter drafts an EAGLE-2 dynamic tree, the
target verifies every node in one forward under the tree mask, the longest matching
root-to-leaf path is accepted (greedy, or at T > 0 along one draw from the target per node),
and the path's K/V entries move into place in the target's cache.

Shapes: B rows, N tree nodes (`total_tokens`), D depth, K nodes kept per depth (`top_k`, also
the root's children), k children drafted per kept node below depth 1 (`children`, K by default),
C = K + (D-1) K k candidates drafted, S cache slots, H hidden, Vd draft vocabulary.

Positions and slots: the root (the row's last verified token) sits at position and slot
base = length - 1; node i is fed at position base + depth(i) and written at slot base + 1 + i
until compaction moves the accepted path to slots base + 1 .. base + L. The drafter keeps its
own cache exactly as for chains (EAGLE's step-0 entries, one position behind the target), and
its tree nodes' K/V in a per-step candidate buffer; after verification it takes in the accepted
path like a chain of the same length (`Eagle3Proposer.advance`).

The target's verify step runs through the kernels as a chain's does (inference/runtime/model.py,
`tree_mask=`): RoPE with the cache write at the tree's slots (kernels/rope_cache.py), then
kernels/tree_attention.py, which reads the tree block straight from the cache slots after the
root and its own mask row per query, with no dense mask over the cache; on a CPU the torch
references run instead. The drafter's tree steps run through the same kernels (the
tree-attention kernel over its cache and its candidate buffer, the fused norms and SwiGLU of
chains; each depth's selection inside its head's merge and the next step's paired input norms:
`_expand`), and the tree step runs eagerly unless TREES_GRAPHED
(inference/runtime/spec_loop.py) says its CUDA graphs were checked on a GPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from inference.proposers.drafters import Eagle3Proposer
from inference.runtime.spec_loop import SpecLoop
from inference.tree.ops import (Tree, expand_level_reference, finalize_candidates, move_entries, sampled_tree_choice,
                            tree_accept)
from inference.runtime.verify import sampling_probs
from draftsmith_kernels.dispatch import use_kernel
from draftsmith_kernels.emit import feed
from draftsmith_kernels.lm_head_topk import norm_lm_head_topk_reference
from draftsmith_kernels.rms_norm import rms_norm, rms_norm_pair
from draftsmith_kernels.rope_cache import rope_cache
from draftsmith_kernels.silu_mul import swiglu_into
from draftsmith_kernels.tree_attention import tree_attention
from draftsmith_kernels.tree_select import Candidates, expand_children_triton, frontier_norm_pair_triton


class EagleTreeProposer(Eagle3Proposer):
    """EAGLE-2 dynamic trees from an EAGLE-3 drafter: `depth` levels, the `top_k` best frontier
    nodes expanded into `children` children each (`top_k` unless given; the root into `top_k`),
    the best `total_tokens` candidates kept (by cumulative draft log-probability; parents always
    before children)."""

    tree = True
    # TreeLoop: draft_tree(feed=..., moves=...) also prepares the verify step (its input, the last
    # verify's cache moves), and advance(..., inputs=...) takes the next input the verify made from `last`
    feeds_verify = True

    def __init__(self, drafter, depth: int, top_k: int, total_tokens: int, batch: int, max_len: int, target_config=None,
                 children: int | None = None):
        super().__init__(drafter, depth, batch, max_len, target_config)
        if not self.fused:
            raise ValueError("draft trees are drafted by EAGLE-3 drafters for now (EAGLE-1: chains)")
        children = top_k if children is None else children
        candidates = tree_candidate_count(depth, top_k, children)
        if depth < 1 or top_k < 1 or children < 1 or not 1 <= total_tokens <= candidates:
            raise ValueError(f"a tree of depth {depth} expanding top_k={top_k} nodes into {children} children drafts "
                             f"{candidates} candidates: total_tokens={total_tokens} must be in 1..{candidates} (and "
                             f"depth, top_k, children >= 1)")
        self.top_k, self.children, self.total_tokens, self.candidates = top_k, children, total_tokens, candidates
        self.verify_tokens = total_tokens  # the verify step feeds the root and these nodes
        # the drafted tree: one set of buffers that every draft writes (the first, eager draft and
        # each captured step alike), so the verify step always reads the latest tree
        long = dict(dtype=torch.long, device=self.last.device)
        self.tree_out = Tree(torch.zeros(batch, total_tokens, **long), torch.zeros(batch, total_tokens, **long),
                             torch.zeros(batch, total_tokens, **long),
                             torch.zeros(batch, total_tokens, total_tokens, dtype=torch.bool, device=self.last.device),
                             torch.zeros(batch, total_tokens, **long))
        # the candidates' K and V [2,B,nkv,C,d], written level by level. No node sees a slot not
        # written this draft (its mask row holds its ancestors and itself); the tree kernel reads
        # only slots some query sees, but the torch path multiplies the others' values by weight
        # 0 (an earlier draft's inf there would make NaN of every later draft): it zeroes the
        # buffer first.
        B, nkv, _, head_dim = self.k_cache.shape
        self.cand_kv = self.k_cache.new_zeros(2, B, nkv, candidates, head_dim)

    @torch.no_grad()
    def draft_tree(self, feed=None, moves=None):
        """The tree below each row's root (inference/tree/ops.py: Tree, positions base + depth).
        feed: (tokens, length, fed, fed_positions), a loop's state and its verify step's input,
        written beside the tree; moves: (k_cache, v_cache, src, dst), the target cache's moves
        after the last verify, made beside it (inference/tree/ops.py `finalize_candidates`)."""
        return draft_eagle_tree(self, self.hidden, self.last, self.k_cache, self.v_cache, self.k, self.top_k,
                                self.total_tokens, out=self.tree_out,
                                cand_kv=self.cand_kv if use_kernel(self.cand_kv) else self.cand_kv.zero_(),
                                children=self.children, feed=feed, moves=moves)


def tree_candidate_count(depth: int, top_k: int, children: int | None = None) -> int:
    """Candidates an EAGLE-2 tree drafts: top_k at depth 1, top_k x children (top_k unless
    given) at every later depth."""
    return top_k + (depth - 1) * top_k * (top_k if children is None else children)


@torch.no_grad()
def draft_eagle_tree(p: Eagle3Proposer, hidden, last, k_cache, v_cache, depth: int, top_k: int, total_tokens: int,
                     out: Tree | None = None, cand_kv: torch.Tensor | None = None, children: int | None = None,
                     feed=None, moves=None):
    """EAGLE-2 selection with an EAGLE-3 drafter `p` (its weights; its own state is not read):
    hidden [B,H] the drafter's output at each row's last step-0 entry, last [B] that entry's
    position, k_cache / v_cache [B,nkv,S,d] its step-0 entries (read up to `last` only, never
    written). The runtime passes its proposer's state; training's held-out walk
    (inference/walks/tree.py) passes the entries of a whole text, one row per anchor, so
    both draft the very same trees. → Tree (inference/tree/ops.py), positions last + 1 + depth
    (into `out`'s tensors when given). cand_kv: zeros [2,B,nkv,C,d] for the candidates' K and
    V (new ones when None). children: what each frontier node below the root is expanded into
    (top_k when None: EAGLE-2's square tree). feed, moves: a loop's verify input, written by the
    rerank, and the target cache's moves after the last verify, made by it (`finalize_candidates`)."""
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
    # positions last + 1 + depth
    return finalize_candidates(cand, children, top_k, total_tokens, last, out, base_offset=1, feed=feed, moves=moves)


def _expand(p: Eagle3Proposer, drafted_from, k: int, index, scores, off: int, level: int, last, cand: Candidates,
            top_k: int, more: bool):
    """One depth of EAGLE-2 selection: the drafter's head over drafted_from [B,F,H] (the outputs at
    the frontier index / scores [B,F], None: the root), each node's best k children written as
    candidates off .. off + F k of `cand`; when the drafter runs on a deeper level (`more`), the
    next frontier (the best top_k of them) and that layer's input: its two normalised halves
    [B,top_k,2H] (token embeddings, parents' hidden states) and the parents' hidden states
    [B,top_k,H] (the residual). → (Frontier, pair, parent_hidden), or three Nones.

    On a GPU three launches (two at the last depth): the head's slices, then their merge writing
    the candidates, then the frontier ranked with the layer's input norms
    (kernels/tree_select.py), where `norm_lm_head_topk_triton`, an expansion and `rms_norm_pair` took
    five; the same numbers either way (elsewhere the torch references)."""
    d = p.drafter
    layer = d.layers[0]
    B, _, H = drafted_from.shape
    parent_hidden = drafted_from.new_empty(B, top_k, H) if more else None
    norms = (d.embed_tokens.weight, layer.input_layernorm.weight, drafted_from, layer.hidden_norm.weight,
             layer.hidden_norm.eps)
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


class TreeLoop(SpecLoop):
    """The device loop with a tree per step: `k` is the tree's depth (the most drafts a step
    accepts), drafting is `proposer.draft_tree()`, verification the tree's longest matching
    path (greedy), or at T > 0 the longest path along one draw from the target after each
    node (the target's distribution exactly: inference/tree/ops.py, sampled_tree_verify)."""

    def __init__(self, model, cache, proposer, batch: int, *args, **kwargs):
        super().__init__(model, cache, proposer, batch, *args, **kwargs)
        # the verify step's input: the root, then the tree's nodes ([B,N+1], N = total_tokens)
        self.fed_ids = self.fed_ids.new_zeros(batch, proposer.verify_tokens + 1)
        self.fed_positions = torch.zeros_like(self.fed_ids)
        # a drafter's rerank writes the verify step's input as it writes the tree, and makes the
        # last verify's cache moves (two launches fewer)
        self.fed_by_draft = self.caps.feeds_verify  # (SpecLoop read the declared capabilities)
        self.moves = None  # (k, v, src, dst): a verify's cache moves, made by the next draft

    def draft_phase(self, moves=None):
        """The tree, in the proposer's buffers: the first draft and the proposer's step are two
        graphs, and both write the one Tree that the verify graph reads (and its input, where the
        proposer feeds it). moves: the last verify's cache moves, which the draft makes (the
        proposer's step passes them; a generation's first draft follows no verify)."""
        if self.fed_by_draft:
            self.tree = self.proposer.draft_tree(feed=(self.tokens, self.length, self.fed_ids, self.fed_positions),
                                                 moves=moves)
        else:
            self.tree = self.proposer.draft_tree()

    def proposer_phase(self):
        """The proposer takes in the verified path, then drafts the next tree, making the verify's
        cache moves as it does (where it feeds the verify): nothing reads the target's cache before."""
        self.advance_phase()
        self.draft_phase(self.moves)

    def verify_phase(self):
        tree, cache, fed, positions = self.tree, self.cache, self.fed_ids, self.fed_positions
        # each row's last token (the root) and the tree's tokens (empty slots fed as 0), at the
        # root's position and the nodes' (one launch on a GPU: kernels/emit.py's feed), unless the
        # draft wrote them
        if not self.fed_by_draft:
            feed(self.tokens, self.length, tree.tokens, fed, positions, tree.positions)
        base, root = positions[:, 0], fed[:, 0]  # [B]: the root's position and slot, its token
        # the root and node i are written at slots base and base + 1 + i; every query sees the
        # cache up to the root, node i also its ancestors and itself (the model builds the rest)
        logits, aux = self.model(fed, positions, cache, self.aux_layers, tree_mask=tree.mask)
        if self.temperature > 0:  # one draw from the target after the root and each node, matched down the tree
            probs = sampling_probs(logits, self.temperature, self.top_k, self.top_p)  # [B,N+1,V]
            u = torch.rand(probs.shape[:2], device=probs.device, generator=self.generator)
            choice, greedy_logits = sampled_tree_choice(probs, u), None
        else:  # the argmax after the root and each node: on a GPU its chunks in parallel (kernels/argmax.py;
            # torch's one program a row scanned 49,152 logits in ~13 µs on an H200), merged by the next launch
            choice, greedy_logits = None, logits
        # the accepted path, what is emitted, the cache's moves and the proposer's next input, and
        # the emission itself (one launch on a GPU: kernels/tree_accept.py)
        accepted = tree_accept(tree.tokens, tree.parents, tree.mask, choice, base, root, self.active, self.k,
                               cache.k.shape[-2], logits=greedy_logits, emit_into=self.emit_state,
                               last=self.proposer.last if self.fed_by_draft else None)
        # the accepted path's entries move from their tree slots to the slots after the root: every
        # layer at once [L,B,nkv,S,d], here or by the next draft (which runs before the next verify)
        if self.fed_by_draft:
            self.moves = (cache.k, cache.v, accepted.src, accepted.dst)
        else:
            move_entries(cache.k, cache.v, accepted.src, accepted.dst)
        # the proposer takes in the path like a chain: [root, path tokens] with their features, rows
        # accepted.index of aux [B*(N+1),W], which its input norm gathers as it reads them; for a
        # proposer that feeds the verify, the same launch made its next tokens and positions from its
        # last position (another makes them itself)
        self.fed, self.aux, self.aux_rows = accepted.fed, aux, accepted.index
        self.accepted, self.bonus = accepted.length, accepted.bonus
        self.next_inputs = None if accepted.next_tokens is None else (accepted.next_tokens, accepted.next_positions)

    def advance_phase(self):
        made = {} if self.next_inputs is None else {"inputs": self.next_inputs}
        self.proposer.advance(self.fed, self.aux, self.accepted, self.bonus, self.active, aux_rows=self.aux_rows,
                              **made)
