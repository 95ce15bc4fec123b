"""The tree step as one plan: its launches in order, what each reads and writes, the work fused
into each as an epilogue, and the invariants that hold it. docs/trees.md explains the step.

Shapes: B rows, N tree nodes (`total_tokens`), D depth (the most drafts a step accepts), K nodes
kept a depth (`top_k`), k children drafted per kept node below depth 1, C = K + (D-1) K k
candidates, S cache slots, V target vocabulary, W the target's aux width, L target layers.

A step, in launch order (an EAGLE-3 tree proposer, `feeds_verify`; `STEP` lists the same):

  draft, for each depth d = 1 .. D (EagleTreeProposer.draft_candidates, inference/tree/loop.py):
   1. head      the drafter's final norm and lm_head over the frontier, the k best of each slice
                (kernels/lm_head_topk.py)                    reads the frontier's hidden states
   2. merge     the slices merged into each frontier node's k best children
                epilogue: expand, the children written as candidates   writes candidates (depth d)
   3. frontier  (d < D) the depth's best K children ranked into the next frontier, beside the
                drafter's input norms of them (kernels/tree_select.py) writes frontier, layer input
   4. layer     (d < D) the drafter's layer on the frontier: RoPE writing K/V to the candidates'
                buffer, tree attention over its cache and the candidates, o_proj, norm, SwiGLU
                                                              writes the next frontier's hidden
   5. rerank    the best N candidates by cumulative score, in candidate order (`rerank`)
                reads candidates; writes buffers.tree
                epilogue feed: the verify step's input (the root, then the nodes)
                                                              writes buffers.verify_input
                epilogue moves: the last verify's accepted K/V moved into place (not after a
                prefill)                                      reads buffers.moves; writes target cache
  verify (TreeLoop.verify):
   6. verify    the target's forward on the root and the nodes under the tree mask, its K/V
                written at slots base .. base + N            reads buffers.verify_input, tree.mask;
                                                              writes logits, buffers.aux
   7. choices   the target's choice after the root and each node: argmax chunks (greedy), or
                one draw from the target's distribution (T > 0)
   8. accept    the longest root-to-leaf path whose nodes match their parents' choices, its
                bonus token and the cache moves (`tree_accept`)
                reads buffers.tree, choices; writes buffers.accepted (its src / dst: buffers.moves)
                prologue: the argmax chunks merged (greedy)
                epilogue emit: the path and bonus into the loop's tokens, lengths, done flags,
                histogram                                     writes the loop's state
                epilogue next input: the drafter's next tokens and positions from its last one
                                                              writes accepted.next_tokens / _positions
  advance (TreeLoop.advance):
   9. advance   the drafter's step-0 entries of the accepted path, as for a chain of that length
                (Eagle3Proposer.advance)                     reads buffers.accepted, buffers.aux;
                                                              writes the drafter's cache, hidden, last

On a GPU the loop runs three CUDA graphs: the first draft (1-5, no moves), the verify (6-8),
after which the host may read the done flags, and the proposer's (9, then 1-5). A proposer that
does not feed the verify (a static tree: tests/test_tree_decoding.py's oracle) hands over a Tree
from `draft_tree()`; the loop then feeds the verify (kernels/emit.py `feed`) and moves the cache
right after accept (`move_entries`), a launch each.

Invariants, each held by a test:
- same bits: every launch writes what its torch reference writes, on the kernel path and on a
  CPU (tests/test_tree_select.py, tests/test_tree_accept.py; the whole loop both ways:
  tests/test_tree_decoding.py `test_tree_verify_through_the_kernels_equals_the_torch_path`);
- the runtime's tree is training's: inference/walks/tree.py drafts with `draft_eagle_tree`, the
  functions the loop launches, and its histogram equals the runtime's
  (tests/test_tree_acceptance.py);
- lossless: greedy tree decoding emits plain greedy decoding's tokens; at T > 0 the target's
  distribution exactly (tests/test_tree_decoding.py, tests/test_tree.py);
- the launches: STEP's kernels in this order, the rerank's move programs only after a verify,
  and no launch of an epilogue's own (tests/test_tree_plan.py; each phase's launch count:
  tests/test_launch_counts.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from draftsmith_kernels.argmax import argmax_chunks
from draftsmith_kernels.dispatch import use_kernel
from draftsmith_kernels.emit import EmitState, Feed, emit_reference, feed, feed_reference
from draftsmith_kernels.tree_accept import Moves, TreeAccept, move_entries_triton, tree_accept_triton
from draftsmith_kernels.tree_select import Candidates, finalize_triton
from inference.runtime.spec_loop import SpecLoop
from inference.runtime.verify import sampling_probs
from inference.tree.ops import (Tree, finalize_reference, move_entries_reference, sampled_tree_choice,
                                tree_accept_reference)


class Launch(NamedTuple):
    """One launch of the step: `kernel`, the Triton kernel that is it on a GPU (None: a model's
    forward, many launches); `depths`: "each" (once a depth), "inner" (every depth but the last)
    or "once"."""
    name: str
    kernel: str | None
    depths: str
    reads: str
    writes: str
    epilogues: tuple[str, ...] = ()


STEP = (
    Launch("head", "_norm_gemv_topk_chunks_kernel", "each", "the frontier's hidden states [B,F,H]",
           "each slice's maximum, sum and k best logits"),
    Launch("merge", "_merge_children_kernel", "each", "the slices; the frontier's indices and scores",
           "candidates off .. off + F k", ("expand: the children written as candidates",)),
    Launch("frontier", "_frontier_norm_pair_kernel", "inner", "the depth's candidates",
           "Frontier [B,K]; the layer's input [B,K,2H]", ("prologue: the rank among the depth's children",)),
    Launch("layer", None, "inner", "the layer's input, the drafter's cache, the candidates' K/V",
           "the frontier's hidden states; its K/V in the candidates' buffer"),
    Launch("rerank", "_rerank_kernel", "once", "Candidates [B,C]", "buffers.tree",
           ("feed: buffers.verify_input", "moves: buffers.moves into the target's cache")),
    Launch("verify", None, "once", "buffers.verify_input, buffers.tree.mask, the target's cache",
           "logits [B,N+1,V], buffers.aux [B,N+1,W], the nodes' K/V at slots base + 1 + i"),
    Launch("choices", "_argmax_chunks_kernel", "once", "logits", "each output's chunk maxima and columns"),
    Launch("accept", "_tree_accept_kernel", "once", "buffers.tree, the choices", "buffers.accepted (moves: src, dst)",
           ("prologue: the argmax chunks merged", "emit: the loop's tokens, lengths, done flags, histogram",
            "next input: accepted.next_tokens / next_positions")),
    Launch("advance", "_keep_entry_kernel", "once", "buffers.accepted, buffers.aux",
           "the drafter's cache, hidden state and last position"),
)


@dataclass
class TreeStepBuffers:
    """What one launch of the step hands a later one, allocated once (a captured replay writes the
    same storage). Written by → read by:

    tree          rerank (or a proposer's draft_tree) → verify (mask), accept
    verify_input  rerank's feed epilogue (or `feed`) → verify: fed / positions [B,N+1]
    aux           verify → advance: the target's features [B,N+1,W] (the model's output, held)
    accepted      accept → advance (fed, index, length, bonus, next_tokens / next_positions)
    moves         accept (accepted.src / dst) → the next rerank's moves epilogue (or `move_entries`)
    """
    tree: Tree | None
    verify_input: Feed
    accepted: TreeAccept
    moves: Moves
    aux: torch.Tensor | None = None


# ---------------------------------------------------------------------------- the tree's own launches
def rerank(cand: Candidates, children: int, top_k: int, total_tokens: int, last, out: Tree | None = None, *,
           feed: Feed | None = None, moves: Moves | None = None) -> Tree:
    """Launch 5: the best `total_tokens` candidates as a Tree, node positions last + 1 + depth
    (last [B]: the drafter's last step-0 position; the root sits at last + 1); into `out`'s
    tensors when given. Epilogues: feed (written as kernels/emit.py's `feed` writes it from the
    tree) and moves (as `move_entries`), inside the launch on CUDA tensors."""
    if use_kernel(cand.tokens):  # (the offset added in the kernel: no launch of its own)
        return Tree(*finalize_triton(cand, children, top_k, total_tokens, last, out, base_offset=1, feed=feed,
                                     moves=moves))
    if moves is not None:
        move_entries_reference(*moves)
    tree = finalize_reference(cand, children, top_k, total_tokens, last + 1)
    if out is not None:
        for buffer, value in zip(out, tree):
            buffer.copy_(value)
        tree = out
    if feed is not None:
        feed_reference(feed.tokens, feed.length, tree.tokens, feed.fed, feed.positions, tree.positions)
    return tree


def tree_accept(tree: Tree, choice, base, root, active, max_depth: int, slots: int, *, logits=None,
                out: TreeAccept | None = None, emit_into: EmitState | None = None, last=None) -> TreeAccept:
    """Launches 7-8 (kernels/tree_accept.py; inference/tree/ops.py `tree_accept_reference`): the
    target's choices [B,N+1], or its logits [B,N+1,V] (choice None: the argmax, its chunks on CUDA,
    their merge inside the accept kernel). base [B] the roots' slots, root [B] their tokens, active
    [B] the rows still generating. Into `out` when given. Epilogues: emit_into, the loop's state
    the step is emitted into (kernels/emit.py `emit`); last [B], the drafter's last position, from
    which its next input is made (next_tokens / next_positions)."""
    if use_kernel(tree.tokens):
        chunks = None
        if logits is not None:
            maxima, columns, _ = argmax_chunks(logits.flatten(0, 1))
            chunks = (maxima, columns)
        return tree_accept_triton(tree.tokens, tree.parents, tree.mask, choice, base, root, active, max_depth, slots,
                                  chunks=chunks, emit_into=emit_into, last=last, out=out)
    if logits is not None:
        choice = logits.argmax(-1)  # [B,N+1] (ties: the lowest id, as the kernels break them)
    accepted = tree_accept_reference(tree.tokens, tree.parents, tree.mask, choice, base, root, active, max_depth,
                                     slots, last)
    if emit_into is not None:
        emit_reference(accepted.path_tokens, accepted.length, accepted.bonus, *emit_into)
    if out is None:
        return accepted
    for buffer, value in zip(out, accepted):
        if value is not None:
            buffer.copy_(value)
    return out if last is not None else out._replace(next_tokens=None, next_positions=None)


def move_entries(moves: Moves):
    """The accepted path's cache moves in a launch of their own (kernels/tree_accept.py), for a
    proposer whose rerank does not make them."""
    return (move_entries_triton if use_kernel(moves.k_cache) else move_entries_reference)(*moves)


# ---------------------------------------------------------------------------- the loop
class TreeLoop(SpecLoop):
    """The device loop with a tree per step: `k` is the tree's depth (the most drafts a step
    accepts). Its phases are the plan's launches (`STEP`) in order: `draft`, `verify`, `advance`;
    every buffer they hand on is in `buffers` (TreeStepBuffers). At T > 0 a step matches one draw
    from the target after the root and each node down the tree (the target's distribution
    exactly: tests/tree_reference.py `sampled_tree_verify`, tests/test_tree.py)."""

    def __init__(self, model, cache, proposer, batch: int, *args, **kwargs):
        super().__init__(model, cache, proposer, batch, *args, **kwargs)
        # the proposer drafts candidates that the plan reranks with the verify's input and the last
        # verify's cache moves as epilogues, and takes in the next input the accept makes
        self.fused = self.caps.feeds_verify  # (SpecLoop read the declared capabilities)
        N, D, dev = self.caps.verify_tokens, self.k, self.tokens.device
        # the verify step's input: the root, then the tree's nodes ([B,N+1])
        self.fed_ids = self.fed_ids.new_zeros(batch, N + 1)
        self.fed_positions = torch.zeros_like(self.fed_ids)
        long = dict(dtype=torch.long, device=dev)
        tree = Tree(torch.zeros(batch, N, **long), torch.zeros(batch, N, **long), torch.zeros(batch, N, **long),
                    torch.zeros(batch, N, N, dtype=torch.bool, device=dev), torch.zeros(batch, N, **long))
        accepted = TreeAccept.empty(batch, D, dev, next_input=self.fused)
        self.buffers = TreeStepBuffers(tree if self.fused else None,
                                       Feed(self.tokens, self.length, self.fed_ids, self.fed_positions), accepted,
                                       Moves(cache.k, cache.v, accepted.src, accepted.dst))

    def draft(self, after_verify: bool):
        """Launches 1-5: the candidates depth by depth, then the rerank into buffers.tree with its
        epilogues: the verify's input, and (after a verify) that verify's cache moves."""
        b, p = self.buffers, self.proposer
        if not self.fused:
            b.tree = p.draft_tree()
            return
        cand = p.draft_candidates()  # 1-4, each depth
        rerank(cand, p.children, p.top_k, p.total_tokens, p.last, b.tree,  # 5
               feed=b.verify_input, moves=b.moves if after_verify else None)

    def verify(self):
        """Launches 6-8: the target's forward over the tree, its choices, and the accept with its
        epilogues (the emission; the drafter's next input)."""
        b = self.buffers
        fed, positions = b.verify_input.fed, b.verify_input.positions
        if not self.fused:  # the verify's input, a launch of its own (kernels/emit.py)
            feed(self.tokens, self.length, b.tree.tokens, fed, positions, b.tree.positions)
        base, root = positions[:, 0], fed[:, 0]  # [B]: the root's position and slot, its token
        # the root and node i are written at slots base and base + 1 + i; every query sees the
        # cache up to the root, node i also its ancestors and itself (the model builds the rest)
        logits, b.aux = self.model(fed, positions, self.cache, self.aux_layers, tree_mask=b.tree.mask)  # 6
        if self.temperature > 0:  # 7: one draw from the target after the root and each node
            probs = sampling_probs(logits, self.temperature, self.top_k, self.top_p)  # [B,N+1,V]
            u = torch.rand(probs.shape[:2], device=probs.device, generator=self.generator)
            choice, greedy_logits = sampled_tree_choice(probs, u), None
        else:  # 7: the argmax after the root and each node, in chunks on a GPU (merged by the accept)
            choice, greedy_logits = None, logits
        tree_accept(b.tree, choice, base, root, self.active, self.k, self.cache.k.shape[-2],  # 8
                    logits=greedy_logits, out=b.accepted, emit_into=self.emit_state,
                    last=self.proposer.last if self.fused else None)
        if not self.fused:  # the accepted path's K/V into place, a launch of its own
            move_entries(b.moves)

    def advance(self):
        """Launch 9: the proposer takes in the accepted path like a chain: [root, path tokens] with
        their features, rows accepted.index of aux [B*(N+1),W], gathered by its input norm."""
        b, a = self.buffers, self.buffers.accepted
        made = {"inputs": (a.next_tokens, a.next_positions)} if self.fused else {}
        self.proposer.advance(a.fed, b.aux, a.length, a.bonus, self.active, aux_rows=a.index, **made)

    # SpecLoop's phases, each one CUDA graph on a GPU
    def draft_phase(self):
        """The first draft of a generation: it follows the prefill, so there are no moves to make."""
        self.draft(after_verify=False)

    def verify_phase(self):
        self.verify()

    def proposer_phase(self):
        """Advance, then the next draft, which makes the verify's cache moves: nothing reads the
        target's cache before it."""
        self.advance()
        self.draft(after_verify=True)
