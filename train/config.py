"""Run configuration: typed dataclasses, YAML recipes mirroring them, dotted overrides.

Everything is validated before any model loads: an unknown key, a wrong type, a missing file
or a layer id beyond the target's depth raises ConfigError naming the key.
"""
from __future__ import annotations

import re

import dataclasses
import difflib
import inspect
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from models import methods


class ConfigError(ValueError):
    pass


@dataclass
class DrafterConfig:
    """What every drafter reads, plus its method's own section: YAML `drafter.<method>` (e.g.
    `drafter.medusa.heads`), the dataclass the method's row of models/methods.py names as
    `options` (declared in the method's model file, with its ranges and checks)."""

    method: str = "eagle3"
    """Drafter family: a method of models/methods.py (eagle3, eagle1, medusa, mtp, dflash)."""
    aux_layer_ids: list[int] | None = None
    """Target layers (output-of-layer ids) fused into the feature; default [1, L//2-1, L-4]
    (EAGLE-3), evenly spaced (DFlash)."""
    draft_vocab_size: int = 16384
    """Vd: most frequent assistant tokens of the training data; equal to V to keep all."""
    options: Any = None
    """The method's section (its row's `options` dataclass, defaults where the config gives
    none); None for a method without fields of its own. Written as `drafter.<method>`."""

    def __post_init__(self):
        if self.options is None:
            row = methods.METHODS.get(self.method)
            if row is not None and row.options is not None:
                self.options = row.options()


@dataclass
class DataConfig:
    dataset: str = "sharegpt"
    """Zoo name, ShareGPT-style JSON, JSONL with `messages`, or an HF dataset."""
    max_length: int = 2048
    """Tokens per conversation after the chat template; longer ones are truncated."""
    limit: int | None = None
    """Use only the first N usable conversations."""
    heldout_fraction: float = 0.02
    """Share of conversations held out (chosen by content hash, so stable)."""
    batch_size: int = 4
    num_workers: int = 2
    num_proc: int | None = None
    """Processes for tokenization (default: up to 8)."""
    chat_template: str | None = None
    """Chat template for a target whose tokenizer has none (or to replace its own): a Jinja
    file, or a named one (chatml, plain). Default: the tokenizer's own."""
    plain_text: bool = False
    """Base models: no chat template; each row's `text` (or a conversation's contents joined by
    blank lines) is tokenized as it is, and the loss covers every token."""
    features: str | None = None
    """A feature store written by `python -m train.extract` for this recipe: training steps read
    the target's features and teacher signal from it instead of running the target (the
    held-out promise still runs the target). A store of another target, layers or data is refused."""


@dataclass
class ObjectiveConfig:
    ttt_steps: int = 7
    """Training-time-test unroll length."""
    ttt_decay: float = 0.8
    """Loss weight of unroll step s is decay**s."""
    token_loss: str = "kl"
    """kl: soft labels, the target's distribution over the draft vocab; ce: hard labels, the data's next tokens."""
    token_weight: float = 1.0
    feature_weight: float = 0.0
    """Smooth-L1 regression of the target's next feature (EAGLE-1), weighted against the token loss."""
    block_anchors: int = 64
    """DFlash: random block anchors per training sequence (inside answers)."""
    joint: bool = False
    """Train the target too (Medusa-2, joint MTP): loss = joint_lambda * drafter loss +
    lm_weight * the target's next-token CE + keep_weight * KL(original target || target)."""
    joint_lambda: float = 0.3
    lm_weight: float = 1.0
    keep_weight: float = 0.0


@dataclass
class OptimConfig:
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio at schedule_steps."""
    target_lr: float = 1.0e-5
    """Joint modes: the target's learning rate (smaller than the drafter's)."""
    schedule_steps: int | None = None
    """Length of the LR schedule (default trainer.max_steps); set it to split one schedule
    over several shorter runs joined with --resume."""
    schedule_by: str = "steps"
    """steps: the cosine runs over schedule_steps. time: it runs over trainer.max_time or
    schedule_steps, whichever ends first, so a time-boxed run ends at the low learning rate
    it was meant to; the time spent survives --resume (wall-clock: not bit-for-bit)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])


@dataclass
class EvalConfig:
    k: int = 7
    """Chain length for predicted acceptance."""
    num_sequences: int = 32
    """Held-out conversations used by each validation."""
    anchors_per_sequence: int | None = None
    """At most this many draft chains per held-out conversation, walked as serving walks the
    answers (the next chain starts after the last one's bonus token). None: every answer whole,
    every turn, as validation serves them. A cap is cheaper but keeps only the start of a long
    conversation (mostly its first answer), so its promise weighs turns and answer positions
    unlike what is served."""
    max_new_tokens: int | None = 256
    """The serving budget per answer the promise is made for: chains are walked only in the
    first max_new_tokens tokens of each held-out answer, as a server that stops an answer there
    serves them (`inference.validate --max-new-tokens`, default 256). Acceptance climbs along an
    answer (EAGLE-3 on held-out regenerated ShareGPT: tau 2.3 in an answer's first 32 tokens,
    3.3 at tokens 128-255, 4.1 at 256-511), so a promise over whole answers over-promises capped serving
    (README, "The answer budget"). None: whole answers."""
    max_length: int = 1024
    every_n_steps: int = 200
    """Validation (loss, accuracy, predicted acceptance) every N training steps."""
    datasets: list[str] | None = None
    """Data sets whose held-out split (same prompt-hash rule) is scored; the first is the one
    stored in the export. Default: data.dataset. E.g. train on regenerated answers and also
    score the original ones."""
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    """Serving temperatures the promise is made for. 0: the greedy promise (always made, the top
    level of predicted_acceptance); each T > 0 adds a sampled promise for standard and block
    verification (`sampled` in predicted_acceptance, inference/walks/sampled.py)."""
    sampled_answers: dict[float, str] = field(default_factory=dict)
    """{T: data set}: the same conversations with answers sampled from the target at T
    (`python -m inference.regenerate --temperature T --heldout-only`), walked for the promise at
    that temperature instead of the greedy answers. Serving at T > 0 walks the target's own
    samples, which a small target makes far less predictable than its greedy answers: without
    them, the promise at T = 1 was 7-31 % above what MT-bench measured (README, "The answer
    budget"). Only the first held-out set's promise uses them."""
    step_costs: str | None = None
    """A step-cost table (inference.runtime.adaptive's StepCosts JSON, measured once per target and
    GPU) to make every promise with adaptive verification too (drafters with a confidence head:
    DSpark): each chain verifies the width the runtime picks for it at batch 1 from its
    confidences. Stored beside the others in `sampled`, verification "adaptive" at T = 0 and
    "adaptive-standard" / "adaptive-block" at T > 0. None: fixed-k promises only."""
    trees: list[list[int]] = field(default_factory=list)
    """EAGLE-2 draft trees the greedy promise is also made for, each [depth, top_k, total_tokens]
    or [depth, top_k, total_tokens, children] (each kept node below the root expanded into that
    many children, not top_k), as `inference.validate --tree D,K,N[,C]` and `inference.bench
    --tree` serve them (EAGLE-3
    drafters): the walk drafts them as the runtime does (`trees` in predicted_acceptance,
    inference/walks/tree.py). Empty: chains only."""


@dataclass
class RunConfig:
    target: str = "smollm2-135m-instruct"
    """Zoo name, HF folder, GGUF file or hub id."""
    target_dtype: str = "auto"
    """auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16 or float16."""
    out_dir: str = "runs/quickstart"
    seed: int = 0
    checkpoint_every_n_steps: int = 100
    export_format: str = "auto"
    """Layout of the export written at the end: auto = the method's own (EAGLE-3: speculators, EAGLE-1: eagle, Medusa: medusa, MTP: mtp, DFlash: dflash)."""
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    trainer: dict = field(default_factory=dict)
    """Keyword arguments of lightning.Trainer (max_steps, precision, devices, ...)."""

    def to_dict(self) -> dict:
        """The config as YAML writes it: the method's section under `drafter.<method>`."""
        tree = dataclasses.asdict(self)
        options = tree["drafter"].pop("options")
        if options is not None:
            tree["drafter"][self.drafter.method] = options
        return tree


# ------------------------------------------------------------------------------ parsing
def _check_type(value, hint, key: str):
    """Return value coerced to `hint` or raise ConfigError naming `key`."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(value, arg, key)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is dict:  # {number: value}: keys read as floats (YAML and JSON give ints or strings)
        key_type, inner = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        out = {}
        for k, v in value.items():
            try:
                number = float(k) if key_type is float and not isinstance(k, bool) else None
            except (TypeError, ValueError):
                number = None
            if number is None:
                raise ConfigError(f"{key}: keys are numbers, got {k!r}")
            out[number] = _check_type(v, inner, f"{key}[{k}]")
        return out
    if origin is list:
        (inner,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_check_type(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {hint}")


def _unknown(key: str, known) -> ConfigError:
    close = difflib.get_close_matches(key.split(".")[-1], list(known), n=1)
    hint = f" (did you mean {'.'.join(key.split('.')[:-1] + [close[0]])}?)" if close else ""
    return ConfigError(f"unknown key {key!r}{hint}")


def _trainer_keys() -> set[str]:
    """lightning.Trainer's keyword arguments, read from the installed Trainer's source: importing
    lightning takes 6-8 s on a 2-core machine, and a recipe's bad key should be one quick line.
    Where the source is not found or not as expected, lightning itself says."""
    names = _trainer_keys_from_source()
    if names is None:
        import lightning

        names = set(inspect.signature(lightning.Trainer.__init__).parameters)
    return names - {"self"}


def _trainer_keys_from_source() -> set[str] | None:
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec("lightning")  # (finds the package without running it)
        source = Path(next(iter(spec.submodule_search_locations)), "pytorch", "trainer", "trainer.py").read_text()
        tree = ast.parse(source)
    except (AttributeError, StopIteration, TypeError, OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Trainer":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    args = item.args
                    if args.vararg or args.kwarg:  # a **kwargs would pass keys the source does not name
                        return None
                    return {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    return None


def _renamed() -> dict[str, str]:
    """{flat drafter key of older configs: its key now}, e.g. medusa_heads → medusa.heads
    (each method's options class says its own, RENAMED)."""
    return {old: f"{name}.{new}" for name, row in methods.METHODS.items() if row.options is not None
            for old, new in row.options.RENAMED.items()}


def upgrade_stored(tree: dict) -> dict:
    """A stored run config (a checkpoint's run_config, an export's training_config) written with
    the flat drafter keys of older versions (drafter.medusa_heads, ...), moved into the method's
    section; the rest as it is. Keys of a method other than the tree's own are dropped (older
    configs kept every method's defaults)."""
    drafter = tree.get("drafter")
    if not isinstance(drafter, dict):
        return tree
    name = drafter.get("method", DrafterConfig.method)
    renamed = _renamed()
    moved = {k: renamed[k] for k in drafter if k in renamed}
    if not moved:
        return tree
    drafter = {k: v for k, v in drafter.items() if k not in moved}
    for old, new in moved.items():
        section, key = new.split(".")
        if section == name:
            drafter.setdefault(section, {})[key] = tree["drafter"][old]
    return {**tree, "drafter": drafter}


def _build_drafter(raw: dict, prefix: str) -> DrafterConfig:
    """The drafter section: its common keys, and the section of its method (`drafter.<method>`)
    built as that method's options dataclass."""
    if not isinstance(raw, dict):
        raise ConfigError(f"drafter: expected a mapping, got {raw!r}")
    name = raw.get("method", DrafterConfig.method)
    if not isinstance(name, str):
        raise ConfigError(f"drafter.method: expected a string, got {name!r}")
    if name not in methods.METHODS:  # read at each call: a test or plugin may register a method
        raise ConfigError(f"drafter.method: {name!r} is not available ({', '.join(methods.METHODS)})")
    row = methods.METHODS[name]
    common = {f.name for f in dataclasses.fields(DrafterConfig)} - {"options"}
    kwargs, options = {}, None
    for key, value in raw.items():
        if key in common:
            kwargs[key] = value
        elif key == name and row.options is not None:
            options = _build(row.options, value or {}, f"{prefix}{name}.")
        elif key in methods.METHODS:
            raise ConfigError(f"{prefix}{key}: a section of method {key}, but drafter.method is {name} "
                              f"(set drafter.method={key}, or drop the section)")
        elif key in _renamed():
            raise ConfigError(f"unknown key {prefix + key!r} (it is {prefix}{_renamed()[key]} now)")
        else:
            raise _unknown(prefix + key, common | ({name} if row.options is not None else set()))
    cfg = _build(DrafterConfig, kwargs, prefix)
    cfg.options = options if options is not None else (row.options() if row.options is not None else None)
    return cfg


def _build(cls, raw: dict, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if key not in names:
            raise _unknown(full, names)
        hint = hints[key]
        if hint is DrafterConfig:
            kwargs[key] = _build_drafter(value or {}, full + ".")
        elif dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value or {}, full + ".")
        elif key == "trainer":
            value = value or {}
            if not isinstance(value, dict):
                raise ConfigError(f"trainer: expected a mapping, got {value!r}")
            allowed = _trainer_keys()
            for tk in value:
                if tk not in allowed:
                    raise _unknown(f"trainer.{tk}", allowed)
            kwargs[key] = dict(value)
        else:
            kwargs[key] = _check_type(value, hint, full)
    return cls(**kwargs)


def set_dotted(tree: dict, dotted: str, value):
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def config_from_dict(tree: dict, overrides: list[str]) -> RunConfig:
    """A checked RunConfig from a stored config tree (the training_config an export keeps, a
    checkpoint's run_config; older flat drafter keys upgraded) with dotted overrides applied."""
    import copy

    return _from_tree(upgrade_stored(copy.deepcopy(tree)), overrides)


def _from_tree(tree: dict, overrides: list[str]) -> RunConfig:
    import copy

    tree = copy.deepcopy(tree)
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(tree, key, value)
    cfg = _build(RunConfig, tree, "")
    from train.config_checks import validate  # (it reads the dataclasses above)

    validate(cfg)
    return cfg


def load_config(path: str | None, overrides: list[str]) -> RunConfig:
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config: file {path} does not exist")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"--config: {path} is not valid YAML ({str(e).splitlines()[0]})") from None
    return _from_tree(tree, overrides)


def max_time_seconds(value) -> float:
    """Lightning's trainer.max_time ("DD:HH:MM:SS" or {days, hours, minutes, seconds}) in seconds."""
    if isinstance(value, str) and re.fullmatch(r"\d+:\d+:\d+:\d+", value.strip()):
        d, h, m, sec = (int(x) for x in value.strip().split(":"))
        total = ((d * 24 + h) * 60 + m) * 60 + sec
    elif isinstance(value, dict) and set(value) <= {"days", "hours", "minutes", "seconds"}:
        total = ((value.get("days", 0) * 24 + value.get("hours", 0)) * 60 + value.get("minutes", 0)) * 60 + value.get("seconds", 0)
    else:
        raise ValueError(f"trainer.max_time must be set as DD:HH:MM:SS, got {value!r}")
    if total <= 0:
        raise ValueError(f"trainer.max_time must be positive, got {value!r}")
    return float(total)


def to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
