"""The kernels' settings, chosen by the caller: which implementation the dispatchers run, and the
tree-attention kernel's tuning. Nothing here is read from the environment.

`KernelSettings` is carried by the runtime model (`RuntimeModel.kernels`, set from a CLI's
`--kernels` / `--tree-attention`) and recorded in the output it affects (bench.json, report.json,
regenerate.json, generate's --stats). `inference.runtime.engine.generate` applies it for the
length of one generation (`applied`): the dispatchers in this folder read `active()`, and graph
and workspace keys hold it, so a step captured under one setting is never replayed under another.
Outside any `applied` block the defaults hold (training's loss kernel, direct kernel calls).

Modes: "auto" (the default): the Triton kernel on CUDA tensors, the torch reference elsewhere;
"off": the torch references everywhere (the bench's "torch ops" row); "force": the kernels on every
device, on a CPU through Triton's interpreter (TRITON_INTERPRET=1; the tests push whole models
through the kernels so).
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

KERNEL_MODES = ("auto", "off", "force")


@dataclass(frozen=True)
class TreeAttentionTuning:
    """Launch settings of kernels/tree_attention.py (the values timed best on an H200 at the
    bench's shapes, BENCHMARKS.md; scripts/bench_attention.py times variants on another GPU).

    The drafter's form (candidates apart from the cache):
    - target_programs: programs per launch the cache split aims at (an H200 has 132 SMs): rows x
      KV heads x score-row tiles that already fill it need few splits, a lone row many.
    - max_block_q: the most score rows (queries x heads of a KV group) a program takes.
    - products_16bit: 16-bit products for 16-bit caches (q, k, v and the probabilities in the
      cache's dtype, float32 sums) instead of TF32 on float32 copies: 0.3-0.6 µs a call faster,
      but the probabilities rounded to bf16's 7 mantissa bits drafted trees of 1.9 % lower tau.
      Float32 caches keep exact float32 products whatever this says.
    - max_block_s: cache keys a tile (128 beat 64 and 32); num_warps: warps a program (4 beat 2, 8).
    - combine_heads: query heads a merge program takes for its token (all of them in one program
      beat one head a program by ~9 % of the attention's time).
    - merge_split_chunk: splits a merge program sums at once (the rest in further chunks, an online
      softmax over chunks): 32 or 64 at once took 1.5-5x longer a call.
    The verify step's form (the tree block in the cache, through decode_attention's kernels):
    - chunked_block_q score rows a program, chunked_heads query heads a merge program, the cache
      cut into at most chunked_max_chunks chunks of 32 slots or more (16 / 16 won at 512-768
      slots; at 4,096 slots 32 rows came first: time it before a long-context serve).
    """
    target_programs: int = 2048
    max_block_q: int = 16
    products_16bit: bool = False
    max_block_s: int = 128
    num_warps: int = 4
    combine_heads: int = 16
    merge_split_chunk: int = 16
    chunked_block_q: int = 16
    chunked_heads: int = 16
    chunked_max_chunks: int = 64

    def __post_init__(self):
        for name, allowed in TREE_ATTENTION_CHOICES.items():
            value = getattr(self, name)
            if isinstance(value, bool) != (name == "products_16bit") or value not in allowed:
                shown = f"{allowed.start}..{allowed.stop - 1}" if isinstance(allowed, range) else \
                    ", ".join(str(int(v)) for v in allowed)
                raise ValueError(f"tree attention: {name}={value!r} is not one of {shown}")

    @classmethod
    def parse(cls, spec: str) -> "TreeAttentionTuning":
        """From "name=value,name=value" (the others at their defaults; the form `spec` writes and
        `--tree-attention` takes); an unknown name or a value out of range is a ValueError naming it."""
        chosen = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            name, _, value = item.partition("=")
            name = name.strip()
            if name not in TREE_ATTENTION_CHOICES:
                raise ValueError(f"tree attention: unknown setting {name!r} (known: {', '.join(TREE_ATTENTION_CHOICES)})")
            try:
                number = int(value)
            except ValueError:
                raise ValueError(f"tree attention: {name}={value!r} is not an integer") from None
            chosen[name] = bool(number) if name == "products_16bit" and number in (0, 1) else number
        return cls(**chosen)

    def spec(self) -> str:
        """Every setting in `parse`'s form (booleans as 0 / 1)."""
        return ",".join(f"{f.name}={int(getattr(self, f.name))}" for f in dataclasses.fields(self))


# the values each setting may take (powers of two where a tile's size follows them; tl.dot's tiles
# are at least 16 wide)
TREE_ATTENTION_CHOICES = {
    "target_programs": range(1, 1 << 20), "max_block_q": (16, 32, 64), "products_16bit": (False, True),
    "max_block_s": (16, 32, 64, 128), "num_warps": (1, 2, 4, 8), "combine_heads": (1, 2, 4, 8, 16),
    "merge_split_chunk": (4, 8, 16, 32, 64), "chunked_block_q": (16, 32, 64), "chunked_heads": (1, 2, 4, 8, 16),
    "chunked_max_chunks": (1, 2, 4, 8, 16, 32, 64)}


@dataclass(frozen=True)
class KernelSettings:
    """Which implementation the dispatchers run (`mode`, one of KERNEL_MODES) and the tree-attention
    kernel's tuning. Frozen and hashable: part of every captured graph's key."""
    mode: str = "auto"
    tree_attention: TreeAttentionTuning = field(default_factory=TreeAttentionTuning)

    def __post_init__(self):
        if self.mode not in KERNEL_MODES:
            raise ValueError(f"kernels: {self.mode!r} is not one of {', '.join(KERNEL_MODES)}")

    def record(self) -> dict:
        """What an output file records of the setting."""
        return {"kernels": self.mode, "tree_attention": self.tree_attention.spec()}


_ACTIVE: ContextVar[KernelSettings] = ContextVar("draftsmith_kernel_settings", default=KernelSettings())


def active() -> KernelSettings:
    """The settings in effect: those of the innermost `applied` block, else the defaults."""
    return _ACTIVE.get()


@contextmanager
def applied(settings: KernelSettings):
    """The dispatchers follow `settings` inside the block (restored on leaving it, also on error)."""
    if not isinstance(settings, KernelSettings):
        raise TypeError(f"expected KernelSettings, got {type(settings).__name__}")
    token = _ACTIVE.set(settings)
    try:
        yield settings
    finally:
        _ACTIVE.reset(token)
