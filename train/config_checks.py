"""Checks of a whole run config that span fields, read files or need the target's shape (but
no model weights): `load_config` runs them after each field's type and range (config.py,
config_ranges.py). Each failure is one ConfigError naming the key.
"""
from __future__ import annotations

from pathlib import Path

from models import methods
from models.options import option_problems
from train.config import ConfigError, RunConfig, max_time_seconds


def _listed(names) -> str:
    """"a", "a and b", "a, b and c"."""
    names = list(names)
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def validate(cfg: RunConfig):
    """Checks that need the file system or the target's shape, but no model weights."""
    from models import zoo

    from train.config_ranges import range_errors

    if cfg.drafter.method not in methods.METHODS:  # read at each call: a test may register a method
        raise ConfigError(f"drafter.method: {cfg.drafter.method!r} is not available ({', '.join(methods.METHODS)})")
    row = methods.METHODS[cfg.drafter.method]
    errors = range_errors(cfg.to_dict())
    if errors:
        raise ConfigError(errors[0])
    if cfg.objective.token_loss not in ("kl", "ce"):
        raise ConfigError(f"objective.token_loss: {cfg.objective.token_loss!r} is not one of kl, ce")
    if cfg.objective.feature_weight < 0 or cfg.objective.token_weight < 0:
        raise ConfigError("objective.token_weight and objective.feature_weight must not be negative")
    if cfg.objective.feature_weight > 0 and not row.feature_regression:
        raise ConfigError(f"objective.feature_weight: feature regression needs a drafter that predicts the target's "
                          f"features ({_listed(n for n, m in methods.METHODS.items() if m.feature_regression)}), "
                          f"not {cfg.drafter.method}")
    if cfg.objective.joint and not row.joint:
        raise ConfigError(f"objective.joint: joint training is for "
                          f"{_listed(n for n, m in methods.METHODS.items() if m.joint)}, not {cfg.drafter.method}")
    if min(cfg.objective.joint_lambda, cfg.objective.lm_weight, cfg.objective.keep_weight) < 0:
        raise ConfigError("objective.joint_lambda, lm_weight and keep_weight must not be negative")
    if cfg.drafter.options is not None:  # the method's own fields: ranges and checks from its file
        errors = option_problems(cfg.drafter.options, cfg, f"drafter.{cfg.drafter.method}")
        if errors:
            raise ConfigError(errors[0])
    if cfg.target_dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ConfigError(f"target_dtype: {cfg.target_dtype!r} is not one of auto, float32, bfloat16, float16")
    if cfg.optim.schedule_by not in ("steps", "time"):
        raise ConfigError(f"optim.schedule_by: {cfg.optim.schedule_by!r} is not one of steps, time")
    if cfg.optim.schedule_by == "time":
        try:
            max_time_seconds(cfg.trainer.get("max_time"))
        except ValueError as e:
            raise ConfigError(f"optim.schedule_by=time: {e}") from None
    strategy = cfg.trainer.get("strategy", "auto")
    if isinstance(strategy, str) and strategy.lower().startswith("fsdp"):
        # train/fsdp.py shards the drafter alone (FSDP2); Lightning's own FSDP variants flatten
        # the bf16 target and the float32 drafter into one flat parameter and fail
        if strategy != "fsdp":
            raise ConfigError(f"trainer.strategy: {strategy!r} is not supported (use fsdp, which shards the drafter only, or ddp)")
        if cfg.objective.joint:
            raise ConfigError("trainer.strategy: fsdp shards the drafter only, and objective.joint trains the target too; use ddp")
    if not zoo.target_exists(cfg.target):
        raise ConfigError(f"target: {cfg.target!r} is not a zoo target, an existing folder with config.json, a .gguf file or a hub id")
    named = [("data.dataset", cfg.data.dataset)] + [(f"eval.datasets[{i}]", d) for i, d in enumerate(cfg.eval.datasets or [])]
    for key, ds in named:
        if ds not in zoo.ASSETS and not Path(ds).expanduser().exists() and ("/" not in ds or ds.startswith((".", "/"))):
            raise ConfigError(f"{key}: {ds!r} is not a zoo data set or an existing file")
    if cfg.data.chat_template is not None:
        from data.templates import template_source_problem

        problem = template_source_problem(cfg.data.chat_template)
        if problem:
            raise ConfigError(f"data.chat_template: {problem}")
        if cfg.data.plain_text:
            raise ConfigError("data.chat_template and data.plain_text=true exclude each other (plain text uses no template)")
    if cfg.eval.datasets is not None and not cfg.eval.datasets:
        raise ConfigError("eval.datasets: give at least one data set, or leave it unset")
    temps = cfg.eval.temperatures
    if not isinstance(temps, list) or not temps or any(isinstance(t, bool) or not isinstance(t, (int, float))
                                                      or not 0 <= t < float("inf") for t in temps):
        raise ConfigError(f"eval.temperatures: a non-empty list of temperatures >= 0, got {temps!r}")
    if len(set(map(float, temps))) != len(temps):
        raise ConfigError(f"eval.temperatures: {temps} lists a temperature twice")
    for t in cfg.eval.sampled_answers:
        if not (t > 0 and t in map(float, temps)):
            raise ConfigError(f"eval.sampled_answers: answers sampled at T = {t:g} serve no promise: the key must be a "
                              f"temperature > 0 listed in eval.temperatures ({temps})")
    if cfg.eval.step_costs is not None:
        if not getattr(cfg.drafter.options, "confidence_head", False):
            raise ConfigError(f"eval.step_costs: adaptive verification reads a confidence head, which this "
                              f"{cfg.drafter.method} drafter has not (drafter.method: dspark with drafter.dspark.confidence_head)")
        from inference.runtime.adaptive import StepCosts

        try:
            StepCosts.load(cfg.eval.step_costs).row(1, cfg.eval.k)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"eval.step_costs: {str(e).strip(chr(39))}") from None
    if cfg.eval.trees and not row.trees:
        raise ConfigError(f"eval.trees: draft trees are drafted by {_listed(n for n, m in methods.METHODS.items() if m.trees)} "
                          f"drafters for now, not {cfg.drafter.method} (leave eval.trees empty)")
    from inference.walks.tree import canonical_tree

    if len({canonical_tree(t) for t in cfg.eval.trees}) != len(cfg.eval.trees):
        raise ConfigError(f"eval.trees: {cfg.eval.trees} lists a tree twice")
    own = methods.default_layout(cfg.drafter.method)
    if cfg.export_format not in ("auto", own):
        raise ConfigError(f"export_format: {cfg.export_format!r} cannot carry a {cfg.drafter.method} drafter "
                          f"(use auto or {own})")
    try:
        layers = zoo.target_num_layers(cfg.target)
        context = zoo.target_context_length(cfg.target)
    except zoo.AssetError as e:
        raise ConfigError(f"target: {e}") from None
    for key in ("data.max_length", "eval.max_length"):
        value = getattr(cfg.data if key.startswith("data") else cfg.eval, "max_length")
        if context is not None and value > context:
            raise ConfigError(f"{key}: {value} tokens is beyond the target's context window of {context}")
    if layers is not None and cfg.drafter.aux_layer_ids is not None:
        for i, layer in enumerate(cfg.drafter.aux_layer_ids):
            if not 0 <= layer < layers:
                raise ConfigError(f"drafter.aux_layer_ids[{i}]: layer {layer} is out of range for the {layers}-layer target (0..{layers - 1})")
    ids = cfg.drafter.aux_layer_ids or []
    if any(b <= a for a, b in zip(ids, ids[1:])):  # servers capture layers sorted and de-duplicated
        raise ConfigError(f"drafter.aux_layer_ids: {ids} must be strictly increasing (vLLM sorts and de-duplicates "
                          f"them, SGLang captures in layer order: use {sorted(set(ids))})")
    if "max_steps" not in cfg.trainer and not cfg.trainer.get("fast_dev_run"):
        raise ConfigError("trainer.max_steps: required (training length is counted in optimizer steps)")
