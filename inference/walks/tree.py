"""Tree-aware predicted acceptance: training's held-out walk drafts EAGLE-2 trees exactly as the
runtime's EagleTreeProposer drafts them, and judges them with the runtime's own acceptance.

One definition on both sides: the trees come from `draft_eagle_tree` (inference/tree/loop.py,
the function `EagleTreeProposer.draft_tree` calls), the accepted length of each tree from
`greedy_tree_verify` (inference/tree/ops.py, what `TreeLoop` verifies with), tau from
`Acceptance.from_histogram` over the accepted-length histogram [depth+1] (what the runtime's
stats report). Only the target's choices come from elsewhere: from the text where it can tell
them, else from one target forward over the accepted path grafted onto the text.

The walk is the chain walk's (inference/walks/greedy.py: `serving_walk`): each answer span from
its first token, the next tree's root one token after the last accepted one (the bonus token).
A tree at anchor a hangs below the root x_{a+1}; the drafter reads its step-0 entries 0..a
(entry t pairs x_{t+1} with the target's feature g_t), as the runtime's proposer holds them
when x_{a+1} is the last verified token.
"""
from __future__ import annotations

import torch

from inference.walks.greedy import anchorable_from, walk_answer, window_for
from inference.tree.ops import greedy_tree_verify
from inference.tree.loop import draft_eagle_tree, tree_candidate_count
from models.acceptance import Acceptance, Prediction, TreePromise
from models.methods import check_tree_drafter

UNKNOWN = -2  # a target choice the text cannot tell: equals no token and no empty slot (-1)


def tree_label(tree) -> str:
    """(depth, top_k, total[, children]) → "D,K,N[,C]", as --tree takes it."""
    return ",".join(str(x) for x in tree)


def tree_words(tree) -> str:
    """(depth, top_k, total[, children]) → "depth D, top-k K[, C children], N nodes"."""
    depth, top_k, total, *children = tree
    wide = "".join(f"{c} {'child' if c == 1 else 'children'}, " for c in children)
    return f"depth {depth}, top-k {top_k}, {wide}{total} nodes"


def canonical_tree(tree) -> tuple[int, ...]:
    """A tree's one name: (depth, top_k, total), with a fourth number, children, only where it
    differs from top_k (D,K,N,K drafts the very tree D,K,N does)."""
    depth, top_k, total, *children = tree
    return (depth, top_k, total) + tuple(c for c in children if c is not None and c != top_k)


def tree_spec_problem(depth, top_k, total, children=None) -> str | None:
    """Why (depth, top_k, total_tokens[, children]) is no tree the runtime can draft, or None."""
    numbers = (depth, top_k, total) + (() if children is None else (children,))
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in numbers):
        return "depth, top-k, nodes and children must be integers"
    if min(numbers) < 1:
        return "depth, top-k, nodes and children must be positive"
    if total > tree_candidate_count(depth, top_k, children):
        return f"nodes at most the {tree_candidate_count(depth, top_k, children)} candidates such a tree drafts"
    return None


@torch.no_grad()
def text_states(p, ids, features):
    """The drafter's step-0 entries over one text, as the runtime's proposer builds them while
    serving it (`Eagle3Proposer.begin` / `advance`: the same layer through the same kernels).

    p: an Eagle3Proposer of batch 1 with a cache of at least n - 1 slots; ids [n], features
    [n,W] (the target's aux layers at each position). Entry t pairs x_{t+1} with g_t; their
    K/V go to p.k_cache[0, :, :n-1]. → hidden [n-1,H], the drafter's output at each entry."""
    n = ids.shape[0]
    fused = p.drafter.fuse(features[None, : n - 1].to(p.drafter.fc.weight.dtype))
    return p._run(ids[None, 1:n], fused, torch.arange(n - 1, device=ids.device)[None])[0]


def text_choices(ids, greedy, anchors, tree):
    """The target's choices [A,N+1] the text can tell, for trees below the roots x_{a+1}:
    column 0 after the root (greedy[a+1]), column i+1 after node i, known when node i and its
    ancestors follow the text (its path is x_{a+2..a+1+depth}: the choice is greedy there),
    else UNKNOWN. ids, greedy [n] (greedy[t]: the target's argmax after x_0..x_t); anchors [A]."""
    n = ids.shape[0]
    pos = tree.positions  # [A,N] a + 1 + depth: the text index a node's token would hold
    inside = pos <= n - 1
    follows = (tree.tokens == ids[pos.clamp(max=n - 1)]) & inside
    on_text = ~(tree.mask & ~follows[:, None, :]).any(-1)  # itself and every ancestor follow the text
    nodes = torch.where(on_text, greedy[pos.clamp(max=n - 1)], UNKNOWN)
    return torch.cat([greedy[anchors + 1][:, None], nodes], 1)


def tree_lengths(target, p, ids, greedy, hidden, anchors, depth: int, top_k: int, total: int,
                 children: int | None = None) -> torch.Tensor:
    """Accepted lengths [A] of the trees the runtime drafts below the roots x_{a+1} (anchors [A])
    of one text (ids, greedy [n]; hidden [n-1,H] and p's cache from `text_states`).

    Greedy acceptance needs the target's choice after the root and after each accepted node.
    The accepted nodes are the target's greedy path, so a choice the text cannot tell matters
    only at the deepest accepted node, and only when it has children; there the path is grafted
    onto the text (`Target.greedy_after_chains`, one forward for every such tree) and the tree
    is verified again, until no accepted node with children is left unknown (at most depth
    rounds; none on the target's own answers but at their end)."""
    S = int(anchors.max()) + 1  # cache slots any of these trees reads
    A = anchors.shape[0]
    k_cache = p.k_cache[:, :, :S].expand(A, -1, -1, -1)  # one text's entries, shared by its anchors
    v_cache = p.v_cache[:, :, :S].expand(A, -1, -1, -1)
    tree = draft_eagle_tree(p, hidden[anchors], anchors, k_cache, v_cache, depth, top_k, total, children=children)
    choice = text_choices(ids, greedy, anchors, tree)
    rows = torch.arange(A, device=ids.device)
    while True:
        path, length, _ = greedy_tree_verify(tree.tokens, tree.parents, choice, max_depth=depth)  # path [A,depth]
        leaf = path[rows, (length - 1).clamp_min(0)]  # the deepest accepted node (length 0: the root, known)
        column = torch.where(length > 0, leaf + 1, 0)
        unknown = choice[rows, column] == UNKNOWN
        has_children = (tree.parents == leaf[:, None]).any(1)
        graft = (length > 0) & unknown & has_children
        if not bool(graft.any()):
            return length
        g = graft.nonzero()[:, 0]
        c = int(length[g].max())
        # the accepted paths' tokens [m,c]; past a path's end the fill is never read (causal)
        chains = tree.tokens[g].gather(1, path[g, :c].clamp_min(0))
        after = target.greedy_after_chains(ids, anchors[g], chains)  # [m,c]
        choice[g, column[g]] = after[torch.arange(g.numel(), device=ids.device), length[g] - 1]


@torch.no_grad()
def predicted_tree_histograms(target, drafter, ids, loss_mask, lengths, trees, anchors_per_sequence: int | None,
                              features=None, greedy=None, window: int | None = None, per_turn: bool = False) -> dict:
    """{(depth, top_k, total_tokens[, children]): accepted-length histogram [depth+1]} of the trees the runtime
    drafts, walked as serving walks (`acceptance.predicted_histogram`'s arguments; per_turn:
    [2, depth+1], first answer span then later spans). Trees are drafted `window` anchors at a
    time (each reads the text's cache up to its anchor: memory ~ window x T entries); by default
    128, or what a capped walk reaches (anchors_per_sequence trees of at most depth + 1 tokens):
    a window's launches are the same for 32 anchors or 128, and a text's walk takes ~T / window."""
    from inference.proposers.drafters import Eagle3Proposer

    check_tree_drafter(drafter)
    if features is None or greedy is None:
        out = target(ids)
        features = drafter.features(out)
        _, greedy = target.head_outputs(out.last_hidden)
    hists = {tuple(t): torch.zeros(2, t[0] + 1, dtype=torch.long) for t in trees}
    window = window or window_for(anchors_per_sequence, max(t[0] for t in hists), 128)
    # the runtime's fused weights, taken now (training moves them between validations); drafting
    # in the drafter's own dtype whatever the training's autocast, as the runtime's proposer drafts
    with torch.autocast(ids.device.type, enabled=False):
        p = Eagle3Proposer(drafter, 1, 1, max(ids.shape[1] - 1, 1))
        for b in range(ids.shape[0]):
            n = int(lengths[b])
            answer = loss_mask[b, :n].bool().tolist()
            if not any(True for _ in anchorable_from(answer, 0)):
                continue
            hidden = text_states(p, ids[b, :n], features[b, :n])
            for tree in hists:
                def measure(found, tree=tree):
                    anchors = torch.as_tensor(found, device=ids.device)
                    return tree_lengths(target, p, ids[b, :n], greedy[b, :n], hidden, anchors, *tree).tolist()

                for _, later, accepted in walk_answer(answer, anchors_per_sequence, window, measure):
                    hists[tree][int(later), accepted] += 1
    return hists if per_turn else {t: h.sum(0) for t, h in hists.items()}


def tree_promises(hists: dict) -> tuple[TreePromise, ...]:
    """predicted_acceptance["trees"]: per tree its settings and acceptance as for chains (a, tau,
    num_chains = trees drafted, histogram, per_turn) from per-turn histograms
    {(depth, top_k, total[, children]): [2, depth+1]}."""
    return tuple(TreePromise(*tree[:3], Acceptance.by_turn(h), *tree[3:]) for tree, h in hists.items())


def tree_promise(predicted: Prediction | None, tree) -> TreePromise:
    """The promise for this tree in an export's predicted acceptance; a one-line error if none."""
    tree = canonical_tree(tree)
    entries = predicted.heldout.trees if predicted else ()
    for entry in entries:
        if canonical_tree(entry.shape) == tree:
            return entry
    held = "; ".join(tree_label(e.shape) for e in entries)
    raise ValueError(f"--tree {tree_label(tree)}: the export promises no such tree "
                     + (f"(it promises {held})" if held else
                        f"(it promises no trees: train with eval.trees=[{list(tree)}])"))


def tree_proposers(drafter, tree, target_config):
    """make_proposer(prompts, max_len) for validate's `measure`: one EagleTreeProposer per (batch,
    cache length), reused as measure reuses its chain proposers (graphs captured once)."""
    from inference.tree.loop import EagleTreeProposer

    built = {}

    def make(prompts, max_len):
        key = (len(prompts), max_len)
        if key not in built:
            depth, top_k, total, *children = tree
            built[key] = EagleTreeProposer(drafter, depth, top_k, total, len(prompts), max_len, target_config,
                                           children=children[0] if children else None)
        return built[key]

    return make
