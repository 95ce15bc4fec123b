"""A method's own section of the run config, declared in the method's file.

The run config's `drafter` section holds what every drafter reads (`method`, `aux_layer_ids`,
`draft_vocab_size`) and one sub-section named after the method, e.g.

    drafter:
      method: medusa
      medusa: {heads: 4, layers: 1}

whose fields are a dataclass in models/medusa.py (its `Method` row's `options`). That class
also states its fields' ranges (`RANGES`), its checks against the rest of the run config
(`problems`) and the flat keys older configs used (`RENAMED`), so adding a method touches no
file of train/. train/config.py builds and checks the section; it knows none of its fields.

The range predicates below are shared with train/config_ranges.py (which imports them: models
sits below train in the layer order).
"""
from __future__ import annotations

import math
from typing import ClassVar


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def positive_int(v) -> bool:
    return _int(v) and v > 0


def non_negative_int(v) -> bool:
    return _int(v) and v >= 0


def positive(v) -> bool:
    return _number(v) and v > 0


def non_negative(v) -> bool:
    return _number(v) and v >= 0


def int_in(lo: int, hi: int):
    def inner(v):
        return _int(v) and lo <= v <= hi
    return inner


def optional(check):
    def inner(v):
        return v is None or check(v)
    return inner


class MethodOptions:
    """Base of a method's run-config section (a dataclass whose fields carry attribute
    docstrings). Subclasses set the class variables and may override `problems`."""

    RANGES: ClassVar[tuple] = ()
    """(field, check, what the value must be): one error line `drafter.<method>.<field>: must be
    <what>, got <value>` per field outside its range."""
    RENAMED: ClassVar[dict] = {}
    """{flat key older configs put in `drafter` (e.g. "medusa_heads"): this section's field}: a
    stored config is upgraded, a user's old key is refused with a line naming the new one."""

    def problems(self, run, key: str) -> list[str]:
        """Checks that span this section and the rest of the run config `run` (a RunConfig: its
        eval, objective, ... sections); `key` is this section's dotted key (drafter.<method>).
        One message per problem, each naming its key."""
        return []


def option_problems(options: MethodOptions, run, key: str) -> list[str]:
    """Range errors of the section's fields first (table order), then its own checks."""
    errors = [f"{key}.{name}: must be {what}, got {getattr(options, name)!r}"
              for name, check, what in type(options).RANGES if not check(getattr(options, name))]
    return errors or list(options.problems(run, key))
