"""Argument checks shared by the runtime's command lines (generate, validate, bench,
regenerate): one table of numeric ranges, the device, and the target's context window, all
before any model loads. Each failure is one line (CliError) and exit code 2."""
from __future__ import annotations

import argparse
import sys


class CliError(ValueError):
    pass


class Parser(argparse.ArgumentParser):
    """argparse with defaults in --help and usage errors as one line, exit code 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        for name in TEXT_ARGUMENTS:  # text fed to a tokenizer; paths may hold any bytes (surrogate-escaped)
            value = getattr(parsed, name, None)
            if isinstance(value, str) and not _is_utf8(value):
                self.error(f"--{name.replace('_', '-')}: not UTF-8 text (byte 0x{_first_bad_byte(value):02x}); "
                           "give the text in UTF-8")
        return parsed


TEXT_ARGUMENTS = ("prompt", "system")


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _first_bad_byte(text: str) -> int:
    ch = next(c for c in text if 0xDC80 <= ord(c) <= 0xDCFF or 0xD800 <= ord(c) <= 0xDFFF)
    return ord(ch) - 0xDC00 if 0xDC80 <= ord(ch) <= 0xDCFF else 0


def fail(message) -> int:
    print(f"error: {str(message).strip(chr(39))}", file=sys.stderr)
    return 2


def at_least(n):
    def check(v):
        return v is None or v >= n
    check.what = f"at least {n}"
    return check


def not_negative(v):
    return v is None or v >= 0


not_negative.what = ">= 0"


def positive(v):
    return v is None or v > 0


positive.what = "positive"


def add_kernel_flags(ap: argparse.ArgumentParser, tuning: bool = False) -> None:
    """--kernels (and with `tuning`, --tree-attention): the runtime's kernel settings
    (kernels/settings.py), read back by `kernel_settings`."""
    from draftsmith_kernels.settings import KERNEL_MODES

    ap.add_argument("--kernels", default="auto", choices=KERNEL_MODES,
                    help="the runtime's Triton kernels: auto (on CUDA, torch elsewhere), off (torch everywhere), "
                         "force (every device; a CPU needs TRITON_INTERPRET=1)")
    if tuning:
        ap.add_argument("--tree-attention", default="", metavar="NAME=VALUE,...",
                        help="the tree-attention kernel's launch settings over their defaults "
                             "(kernels/settings.py TreeAttentionTuning; scripts/bench_attention.py prints the best)")


def kernel_settings(args, device: str):
    """The KernelSettings of `add_kernel_flags`' flags for a run on `device`; CliError on a bad
    --tree-attention, or kernels forced onto a CPU without Triton's interpreter."""
    from draftsmith_kernels.dispatch import INTERPRETED
    from draftsmith_kernels.settings import KernelSettings, TreeAttentionTuning

    if args.kernels == "force" and not str(device).startswith("cuda") and not INTERPRETED:
        raise CliError("--kernels force: the kernels run on a CPU only under Triton's interpreter (TRITON_INTERPRET=1)")
    try:
        return KernelSettings(mode=args.kernels,
                              tree_attention=TreeAttentionTuning.parse(getattr(args, "tree_attention", "") or ""))
    except ValueError as e:
        raise CliError(f"--tree-attention: {e}") from None


def check_ranges(args, table: dict) -> None:
    """table: {attribute: check}; CliError naming the first flag out of range."""
    import math

    for name, check in table.items():
        value = getattr(args, name, None)
        if isinstance(value, float) and not math.isfinite(value):  # float("inf") and "nan" parse as floats
            flag = "--" + name.replace("_", "-")
            raise CliError(f"{flag}: must be a finite number, got {value}")
        if not check(value):
            flag = "-k" if name == "k" else "--" + name.replace("_", "-")
            raise CliError(f"{flag}: must be {check.what}, got {value}")


# the largest tree served: EAGLE-2 trees in use verify tens to a few hundred tokens a step
MAX_TREE_DEPTH, MAX_TREE_NODES = 32, 1024


def parse_tree_spec(spec: str, flag: str = "--tree") -> tuple[int, ...]:
    """DEPTH,TOPK,NODES[,CHILDREN] → three or four positive ints, NODES at most the candidates such
    an EAGLE-2 tree drafts (inference/walks/tree.py: tree_spec_problem); CHILDREN: what each
    kept node below the root is expanded into (TOPK unless given; dropped when it is TOPK)."""
    from inference.walks.tree import canonical_tree, tree_spec_problem

    try:
        tree = tuple(int(x) for x in spec.split(","))
    except ValueError:
        tree = ()
    if len(tree) not in (3, 4):
        raise CliError(f"{flag} {spec}: expected DEPTH,TOPK,NODES[,CHILDREN], three or four integers (e.g. 5,8,48 "
                       "or 4,8,40,4)")
    problem = tree_spec_problem(*tree)
    if problem:
        raise CliError(f"{flag} {spec}: {problem}")
    if tree[0] > MAX_TREE_DEPTH or tree[2] > MAX_TREE_NODES:
        raise CliError(f"{flag} {spec}: at most depth {MAX_TREE_DEPTH} and {MAX_TREE_NODES} nodes (a tree verifies NODES + 1 "
                       "tokens a step and drafts DEPTH levels of TOPK x TOPK candidates; a larger one exhausts memory "
                       "before it serves)")
    return canonical_tree(tree)


def resolve_device(spec: str | None) -> str:
    """auto/None → cuda when available, else cpu; cuda without CUDA is an error."""
    import torch

    if spec in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return spec
    if spec == "cuda" or spec.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise CliError(f"--device {spec}: no CUDA device on this machine (torch.cuda.is_available() is false); "
                           "use --device cpu")
        return spec
    raise CliError(f"--device: {spec!r} is not auto, cpu or cuda[:N]")


def context_window(target_path: str) -> int | None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_path)
    config = getattr(config, "text_config", None) or config
    return getattr(config, "max_position_embeddings", None)


def check_fits(prompt_tokens: int, max_new_tokens: int, context: int | None, what: str = "the prompt") -> None:
    """Prompt + new tokens beyond the target's context window decode garbage: refuse it."""
    if context is not None and prompt_tokens + max_new_tokens > context:
        raise CliError(f"{what} ({prompt_tokens} tokens) + --max-new-tokens {max_new_tokens} is beyond the target's "
                       f"context window of {context} tokens; shorten it or lower --max-new-tokens")


def check_output_folder(out: str, own_file: str | None = None, flag: str = "--out", tool: str | None = None,
                        keep: tuple = (), replaces: bool = True) -> None:
    """An output folder: absent (created later), empty, or one this command wrote before, and
    writable; never a file, never a folder of the user's own. tool: the command's name; a
    non-empty folder must carry its marker (export/paths.py, never a file name) and hold nothing
    the marker does not list, nor any of `keep` (the command's inputs), since the command
    replaces it whole (replaces=False: a command that only adds to its own files there, which
    leaves other files be). own_file (without tool): a command that only adds its own file to the
    folder; a non-empty folder must hold that file. The folder's lock is taken for the rest of
    the command (a second command into it is refused)."""
    from pathlib import Path

    from export.io import output_lock
    from export.paths import MARKER, OutputPathError, check_replaceable, check_writable, read_marker

    path = Path(out)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise CliError(f"{flag}: {out} is an existing file, not a folder; refusing to write over it")
    try:
        check_writable(Path(out), flag)
        if tool:
            output_lock(path, flag)
            if path.is_dir() and any(path.iterdir()):
                if replaces:
                    check_replaceable(path, tool, flag, keep)
                elif (read_marker(path) or {}).get("tool") != tool:
                    raise OutputPathError(f"{flag}: {out} is an existing folder not written by {tool} (no {MARKER} "
                                          f"naming {tool}); refusing to write into it (choose a new folder)")
    except OutputPathError as e:
        raise CliError(str(e)) from None
    if own_file and not tool and path.is_dir() and any(path.iterdir()) and not (path / own_file).is_file():
        raise CliError(f"{flag}: {out} is a folder of other files (no {own_file} from an earlier run of this command); "
                       "refusing to write into it (choose a new folder)")


def check_new_tokens_fit(target: str | None, max_new_tokens: int) -> None:
    """--max-new-tokens alone beyond the target's context window (known without loading it)."""
    from models.zoo import target_context_length

    context = target_context_length(target) if target else None
    if context is not None and max_new_tokens >= context:
        raise CliError(f"--max-new-tokens {max_new_tokens} is beyond the target's context window of {context} tokens "
                       "(with a prompt in front)")


def check_output_file(path: str, first_line: str, flag: str) -> None:
    """A file this command writes: new, or one it wrote before (it starts with `first_line`)."""
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        raise CliError(f"{flag}: {path} is a folder, not a file")
    if p.exists():
        with open(p, "rb") as f:
            head = f.read(len(first_line.encode()))
        if head != first_line.encode():
            raise CliError(f"{flag}: {path} exists and was not written by this command; refusing to replace it")
    check_output_folder(str(p.parent) if str(p.parent) else ".", flag=flag)
