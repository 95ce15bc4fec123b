"""Range checks of every numeric (and enumerated) config field, as one table.

Types are checked by train/config.py from the dataclasses; this table says which values of
each type make sense. A method's own fields (`drafter.<method>.*`) are ranged in the method's
file (its options class's RANGES, models/options.py). `trainer.*` entries check the Lightning arguments draftsmith relies on
(the rest go to lightning.Trainer, whose own errors become one line too).
"""
from __future__ import annotations

from models.options import _int, _number, non_negative, non_negative_int, optional, positive, positive_int  # noqa: F401

_MISSING = object()


def fraction_open(v) -> bool:  # (0, 1)
    return _number(v) and 0 < v < 1


def fraction_closed(v) -> bool:  # [0, 1]
    return _number(v) and 0 <= v <= 1


def decay(v) -> bool:  # (0, 1]
    return _number(v) and 0 < v <= 1


def betas(v) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(_number(b) and 0 <= b < 1 for b in v)


def layer_ids(v) -> bool:
    return v is None or (isinstance(v, list) and len(v) > 0 and all(non_negative_int(i) for i in v))


def draft_trees(v) -> bool:
    """[[depth, top_k, total_tokens(, children)], ...]: positive integers, total_tokens at most the
    top_k + (depth - 1) top_k children candidates such an EAGLE-2 tree drafts (children: top_k
    unless given)."""
    from inference.walks.tree import tree_spec_problem

    return isinstance(v, list) and all(isinstance(t, list) and len(t) in (3, 4) and tree_spec_problem(*t) is None
                                       for t in v)


def seed(v) -> bool:  # what numpy's and Lightning's seeding take
    return non_negative_int(v) and v <= 2**32 - 1


def fast_dev_run(v) -> bool:
    return isinstance(v, bool) or positive_int(v)


def devices(v) -> bool:
    return v == "auto" or v == -1 or positive_int(v) or (isinstance(v, list) and len(v) > 0 and all(non_negative_int(i) for i in v))


ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")
PRECISIONS = ("auto", "32-true", "32", 32, "16-mixed", "16", 16, "bf16-mixed", "bf16", "bf16-true", "16-true",
              "64-true", "64", 64, "transformer-engine")


def one_of(*choices):
    def inner(v):
        return v in choices
    inner.choices = choices
    return inner


# key, check, what the value must be (said in the error line)
RANGES = [
    ("seed", seed, "an integer in [0, 4294967295]"),
    ("checkpoint_every_n_steps", positive_int, "a positive integer"),
    ("drafter.aux_layer_ids", layer_ids, "a non-empty list of non-negative layer ids, or null"),
    ("drafter.draft_vocab_size", positive_int, "a positive integer"),
    ("data.max_length", lambda v: _int(v) and v >= 2, "an integer >= 2"),
    ("data.limit", optional(positive_int), "a positive integer or null"),
    ("data.heldout_fraction", fraction_open, "a fraction in (0, 1): validation needs held-out conversations"),
    ("data.batch_size", positive_int, "a positive integer"),
    ("data.num_workers", non_negative_int, "a non-negative integer"),
    ("data.num_proc", optional(positive_int), "a positive integer or null"),
    ("objective.ttt_steps", positive_int, "a positive integer"),
    ("objective.ttt_decay", decay, "in (0, 1]: step s is weighted decay**s"),
    ("objective.token_weight", non_negative, "a non-negative number"),
    ("objective.feature_weight", non_negative, "a non-negative number"),
    ("objective.block_anchors", positive_int, "a positive integer"),
    ("objective.joint_lambda", non_negative, "a non-negative number"),
    ("objective.lm_weight", non_negative, "a non-negative number"),
    ("objective.keep_weight", non_negative, "a non-negative number"),
    ("optim.lr", positive, "a positive number"),
    ("optim.weight_decay", non_negative, "a non-negative number"),
    ("optim.warmup_steps", non_negative_int, "a non-negative integer"),
    ("optim.min_lr_ratio", fraction_closed, "a fraction in [0, 1]"),
    ("optim.target_lr", positive, "a positive number"),
    ("optim.schedule_steps", optional(positive_int), "a positive integer or null"),
    ("optim.betas", betas, "two numbers in [0, 1)"),
    ("eval.k", positive_int, "a positive integer"),
    ("eval.num_sequences", positive_int, "a positive integer"),
    ("eval.anchors_per_sequence", optional(positive_int), "a positive integer or null"),
    ("eval.max_new_tokens", optional(positive_int), "a positive integer or null"),
    ("eval.max_length", lambda v: _int(v) and v >= 2, "an integer >= 2"),
    ("eval.every_n_steps", positive_int, "a positive integer"),
    ("eval.trees", draft_trees, "a list of [depth, top_k, total_tokens] or [depth, top_k, total_tokens, children], "
                                "positive integers with total_tokens at most the top_k + (depth - 1) * top_k * "
                                "children candidates such a tree drafts (children: top_k unless given)"),
    ("trainer.max_steps", positive_int, "a positive integer (optimizer steps)"),
    ("trainer.fast_dev_run", fast_dev_run, "true, false or a positive number of batches"),
    ("trainer.accumulate_grad_batches", positive_int, "a positive integer"),
    ("trainer.log_every_n_steps", positive_int, "a positive integer"),
    ("trainer.gradient_clip_val", optional(non_negative), "a non-negative number or null"),
    ("trainer.devices", devices, "a positive integer, a list of device ids, -1 or auto"),
    ("trainer.num_nodes", positive_int, "a positive integer"),
    ("trainer.accelerator", one_of(*ACCELERATORS), f"one of {', '.join(ACCELERATORS)}"),
    ("trainer.precision", one_of(*PRECISIONS), "auto, 32-true, bf16-mixed, 16-mixed, bf16-true, 16-true or 64-true"),
]


def lookup(tree: dict, dotted: str):
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def range_errors(tree: dict) -> list[str]:
    """One message per field outside its range, in table order (`tree`: the config as a dict)."""
    errors = []
    for key, check, what in RANGES:
        value = lookup(tree, key)
        if value is _MISSING:
            continue
        if not check(value):
            errors.append(f"{key}: must be {what}, got {value!r}")
    return errors
