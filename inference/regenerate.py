"""python -m inference.regenerate: replace every assistant turn of a data set with the target's own
greedy answer, so a drafter trains on the text it will see when serving.

    python -m inference.regenerate --target smollm2-135m-instruct --dataset sharegpt --out regen/sharegpt \
        [--limit N] [--batch-size 64] [--max-new-tokens 512] [--max-length 2048] [--max-minutes M] [--shard I/N]
        [--temperature T --seed S] [--heldout-only 0.02]

Answers sampled at T (`--temperature T`), of the held-out conversations alone (`--heldout-only`
at training's data.heldout_fraction), are the text the promise at T walks (training's
eval.sampled_answers): serving at T walks the target's samples, not its greedy answers.

A benchmark of questions (`--dataset humaneval` or `mt-bench`) gets the target's answers too,
which makes it a held-out set for a promise of its own: `--dataset humaneval --heldout-only 0.5`
answers half of HumanEval (by prompt hash); a drafter promised on that half (eval.datasets) is
validated on the other half (`inference.validate --dataset humaneval --promise-set FILE`).

Turns are answered in order through the runtime, a batch of conversations at a time (turn r of
every conversation in the batch, then turn r+1 after those answers). A conversation stops at
the first turn whose prompt plus answer budget no longer fits --max-length (training truncates
there anyway) or whose answer hit --max-new-tokens without ending; it keeps the turns before.

Repetition loops: a small target decoding greedily often falls into a loop (the same sentence
over and over) until the token budget cuts it. Left in, such answers teach nothing a drafter
needs and make held-out acceptance look far better than serving will see (every drafter is
right inside a loop). By default an answer cut at the budget that ends in a loop keeps one copy
of the repeated unit and ends there (`--keep-loops` keeps them whole); the summary counts them.

Output: OUT/conversations.jsonl, one line per source conversation in source order:
{"id", "messages", "regenerated_turns", "truncated"} or {"id", "skipped": reason}. Lines are
appended and flushed after each batch; re-running skips finished ids, and a line cut by an
interruption is dropped and redone, so no conversation is lost or written twice.

Several GPUs (a second process on the same GPU adds little: BENCHMARKS.md): run
`--shard 0/N` ... `--shard N-1/N`, each with its own --out; shard I answers the conversations
whose index is I modulo N, and `cat OUT*/conversations.jsonl` is the whole set.

More of an earlier set: `--continue-from OLD.jsonl` (the `cat` of an earlier run, same settings)
copies OLD's lines of this shard's ids into --out first, so the run answers only conversations
OLD lacks, whatever shards wrote OLD; `cat` gives the old and the new together.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

log = logging.getLogger("draftsmith.regenerate")

OUTPUT = "conversations.jsonl"
SETTINGS = "regenerate.json"


def _lines(data: bytes) -> list[bytes]:
    """The complete JSON lines of a file's bytes (split on \\n only: answers may hold U+2028 and
    other characters that str.splitlines() would also split on)."""
    return [line for line in data.split(b"\n") if line.strip()]


def read_finished(path: Path) -> set[int]:
    """Ids already written; a trailing partial line (interrupted write) is cut off the file."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1  # everything after the last newline is an unfinished line
    if keep < len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
    return {json.loads(line)["id"] for line in _lines(data[:keep])}


def _continue_from(old: Path, path: Path, shard: tuple[int, int], finished: set[int], conversations) -> int:
    """Append `old`'s lines of this shard's ids that `path` lacks; returns how many. Each line
    must be a conversation of this source (same id, same first question): a file of another
    data set or limit would otherwise be merged silently. An unfinished last line is left out."""
    from data.sources import first_user_turn

    data = old.read_bytes()
    data = data[: data.rfind(b"\n") + 1] if not data.endswith(b"\n") and b"\n" in data else data
    lines = []
    for n, line in enumerate(_lines(data), 1):
        try:
            record = json.loads(line)
            i = record["id"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{old}, line {n}: not a line of regenerated conversations (invalid JSON or no \"id\")") from None
        if not isinstance(i, int) or not 0 <= i < len(conversations):
            raise ValueError(f"{old}, line {n}: id {i!r} is not a conversation of this source ({len(conversations)})")
        if "messages" in record and first_user_turn(record["messages"]) != first_user_turn(conversations[i]):
            raise ValueError(f"{old}, line {n}: conversation {i} asks another first question than this source's "
                             "(another data set or --limit?)")
        if i % shard[1] == shard[0] and i not in finished:
            lines.append(line + b"\n")
            finished.add(i)
    with open(path, "ab") as f:
        f.write(b"".join(lines))
        f.flush()
        os.fsync(f.fileno())
    return len(lines)


def check_settings(out: Path, settings: dict):
    """A resumed run must use the settings that wrote the finished lines."""
    path = out / SETTINGS
    if path.exists():
        # folders written before --shard / --kernels existed
        old = {"shard": "0/1", "kernels": "auto", **json.loads(path.read_text())}
        changed = [k for k in settings if old.get(k) != settings[k]]
        if changed:
            raise ValueError(f"{out} was written with other settings ({', '.join(f'{k}={old.get(k)!r}' for k in changed)}); "
                             "use a new --out or the same settings")
    else:
        from export.paths import read_marker, write_marker

        out.mkdir(parents=True, exist_ok=True)
        if read_marker(out) is None:  # what makes the folder regenerate's own (export/paths.py), first
            write_marker(out, "regenerate", [SETTINGS, OUTPUT])
        tmp = path.with_name(f".{SETTINGS}.tmp")
        tmp.write_text(json.dumps(settings, indent=2))
        os.replace(tmp, path)


def loop_start(ids: list[int], max_period: int = 256, min_repeat_tokens: int = 32) -> int | None:
    """Where a trailing repetition loop begins: the smallest i such that ids[i:] repeats one unit
    of P <= max_period tokens (ids[j] == ids[j - P] for every j >= i + P) at least twice over and
    for at least min_repeat_tokens past the first copy. Returns i + P (the end of the first copy,
    where the answer should stop), or None when the answer does not end in a loop."""
    import numpy as np

    a = np.asarray(ids)
    n = len(a)
    best = None
    for period in range(1, min(max_period, n // 2) + 1):
        same = a[period:] == a[:-period]  # same[j - P]: ids[j] == ids[j - P]
        mismatch = np.flatnonzero(~same)
        run = len(same) - (mismatch[-1] + 1 if len(mismatch) else 0)  # trailing repeats
        if run >= max(period, min_repeat_tokens):
            end_of_first_copy = n - run  # ids[n-run:] repeats ids[n-run-P : n-run]
            if best is None or end_of_first_copy < best:
                best = end_of_first_copy
    return None if best is None else int(best)


def regenerate_batch(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int, max_length: int,
                     generate_fn=None, keep_loops: bool = False, sampling: dict | None = None) -> tuple[list[dict], int]:
    """Answer every assistant turn of these conversations, turn by turn, batched across them.

    Returns (one output record per conversation, number of tokens generated); a record whose
    last answer was a loop cut to its first copy carries "loop_cut": tokens removed.
    sampling: {"temperature", "generator"} to sample the answers instead (None: greedy)."""
    from data.chat import encode_prompt
    from inference.runtime.engine import generate

    generate_fn = generate_fn or generate
    eos = tokenizer.eos_token_id
    out = [[] for _ in conversations]  # messages so far, with regenerated answers
    cursor = [0] * len(conversations)  # next source message to copy
    answered = [0] * len(conversations)
    truncated = [False] * len(conversations)
    loop_cut = [0] * len(conversations)
    open_rows = list(range(len(conversations)))
    generated = 0
    while open_rows:
        prompts, rows = [], []
        for i in open_rows:
            src = conversations[i]
            while cursor[i] < len(src) and (src[cursor[i]]["role"] != "assistant"
                                            or not any(m["role"] == "user" for m in out[i])):
                if src[cursor[i]]["role"] != "assistant":
                    out[i].append(src[cursor[i]])
                cursor[i] += 1  # an answer before any user turn has no prompt: dropped
            if cursor[i] >= len(src):
                continue  # no more turns to answer
            prompt = encode_prompt(tokenizer, out[i])
            if len(prompt) + max_new_tokens > max_length:
                continue  # training would cut this turn off: stop the conversation here
            prompts.append(prompt)
            rows.append(i)
        if not rows:
            break
        outputs, _ = generate_fn(model, prompts, max_new_tokens, eos_ids=(eos,), **(sampling or {}))
        still_open = []
        for i, ids in zip(rows, outputs):
            ended = bool(ids) and ids[-1] == eos
            generated += len(ids)
            cut = None if ended or keep_loops else loop_start(ids)
            if cut is not None:
                loop_cut[i] = len(ids) - cut
                ids = ids[:cut]
            text = tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=True).strip()
            out[i].append({"role": "assistant", "content": text})
            cursor[i] += 1
            answered[i] += 1
            if ended:
                still_open.append(i)
            else:
                truncated[i] = True  # an answer cut at the budget: later turns would follow a cut answer
        open_rows = still_open
    records = []
    for i, msgs in enumerate(out):
        while msgs and msgs[-1]["role"] != "assistant":
            msgs.pop()  # end on an answer
        if answered[i] == 0:
            records.append({"skipped": f"first prompt does not fit {max_length} tokens with {max_new_tokens} new"})
        else:
            records.append({"messages": msgs, "regenerated_turns": answered[i], "truncated": truncated[i],
                            **({"loop_cut": loop_cut[i]} if loop_cut[i] else {})})
    return records, generated


def _answer_batch(model, tokenizer, conversations, max_new_tokens, max_length, generate_fn, keep_loops, sampling=None):
    """regenerate_batch, then the runtime's caches and graphs released (every batch has shapes of
    its own); a batch that runs out of device memory is answered again in two halves (nothing of
    the failed attempt is kept: records are written only for answered batches)."""
    import torch

    from inference.runtime.graphs import release_workspace

    try:
        return regenerate_batch(model, tokenizer, conversations, max_new_tokens, max_length, generate_fn, keep_loops,
                                sampling)
    except torch.OutOfMemoryError:
        if len(conversations) == 1:
            raise
        # the halves run after this clause: inside it, the traceback's frames would still hold
        # the failed attempt's cache and logits
    finally:
        release_workspace(model)
    half = len(conversations) // 2
    print(f"out of device memory with {len(conversations)} conversations a batch: answering them in two halves")
    first, n1 = _answer_batch(model, tokenizer, conversations[:half], max_new_tokens, max_length, generate_fn, keep_loops,
                              sampling)
    second, n2 = _answer_batch(model, tokenizer, conversations[half:], max_new_tokens, max_length, generate_fn, keep_loops,
                               sampling)
    return first + second, n1 + n2


def regenerate(target: str, dataset: str, out: Path, limit: int | None = None, batch_size: int = 64,
               max_new_tokens: int = 512, max_length: int = 2048, max_minutes: float | None = None,
               device: str | None = None, generate_fn=None, keep_loops: bool = False,
               shard: tuple[int, int] = (0, 1), continue_from: Path | None = None, temperature: float = 0.0,
               seed: int = 0, heldout_only: float | None = None, kernels=None) -> dict:
    """Answer the conversations (the module's docstring). temperature > 0: answers sampled at
    that temperature (seeded; a resumed run draws on from a fresh seed, so it is reproducible
    only when run whole). heldout_only: only the conversations training holds out at that
    data.heldout_fraction (by prompt hash), e.g. answers sampled at T for the promise at T.
    kernels: the runtime's kernel settings (kernels/settings.py KernelSettings; default: the
    defaults), recorded in regenerate.json."""
    import torch
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from data.sources import PROMPT_SETS, load_conversations, prompt_conversations
    from draftsmith_kernels.settings import KernelSettings
    from inference.runtime.fallback import load_runtime
    from models.zoo import resolve_target

    out = Path(out)
    settings = {"target": target, "dataset": dataset, "limit": limit, "max_new_tokens": max_new_tokens,
                "max_length": max_length, "decoding": f"sampled at T = {temperature:g}, seed {seed}" if temperature else "greedy",
                "loops": "kept" if keep_loops else "cut to one copy", "shard": f"{shard[0]}/{shard[1]}",
                "kernels": (kernels or KernelSettings()).mode,
                **({"heldout_only": heldout_only} if heldout_only else {})}
    # a wrong --dataset fails here, before --out is written; a benchmark's questions get answers
    conversations = prompt_conversations(dataset, limit) if dataset in PROMPT_SETS else load_conversations(dataset, limit)
    check_settings(out, settings)
    path = out / OUTPUT
    finished = read_finished(path)
    seeded = _continue_from(continue_from, path, shard, finished, conversations) if continue_from else 0  # adds to finished
    todo = [i for i in range(shard[0], len(conversations), shard[1]) if i not in finished]
    if heldout_only:
        from data.chat import _is_heldout

        todo = [i for i in todo if _is_heldout(conversations[i], heldout_only)]
    summary = {"conversations": len(conversations), "already_done": len(finished), "continued_from": seeded,
               "written": 0, "generated_tokens": 0, "loops_cut": 0}
    if not todo:
        kept = f" (kept {seeded} from {continue_from})" if seeded else ""
        which = "held-out conversations" if heldout_only else f"{len(conversations)} conversations"
        print(f"{path}: all {which} already regenerated{kept}")
        return summary
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    folder = resolve_target(target)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = load_runtime(folder, dtype=dtype, device=device, kernels=kernels)
    sampling = {"temperature": temperature, "generator": torch.Generator(device=device).manual_seed(seed)} \
        if temperature > 0 else None
    t0 = time.time()
    stopped_early = False
    with open(path, "a", encoding="utf-8") as f, tqdm(total=len(todo), desc="regenerating", unit="conv") as bar:
        for start in range(0, len(todo), batch_size):
            ids = todo[start : start + batch_size]
            records, n = _answer_batch(model, tokenizer, [conversations[i] for i in ids], max_new_tokens, max_length,
                                       generate_fn, keep_loops, sampling)
            f.write("".join(json.dumps({"id": i, **r}, ensure_ascii=False) + "\n" for i, r in zip(ids, records)))
            f.flush()
            os.fsync(f.fileno())
            summary["written"] += len(ids)
            summary["generated_tokens"] += n
            summary["loops_cut"] += sum(1 for r in records if r.get("loop_cut"))
            bar.update(len(ids))
            bar.set_postfix(tok_s=f"{summary['generated_tokens'] / max(time.time() - t0, 1e-9):,.0f}")
            if max_minutes is not None and time.time() - t0 > 60 * max_minutes and start + batch_size < len(todo):
                stopped_early = True
                break
    seconds = time.time() - t0
    summary.update(seconds=round(seconds, 1), tokens_per_s=round(summary["generated_tokens"] / max(seconds, 1e-9), 1),
                   complete=not stopped_early)
    left = len(todo) - summary["written"]
    kept = f"kept {seeded} from {continue_from}; " if seeded else ""
    print(f"{kept}wrote {summary['written']} conversations ({summary['generated_tokens']:,} tokens, "
          f"{summary['tokens_per_s']:,.0f} tok/s) to {path}; {summary['loops_cut']} answers ended in a repetition loop"
          + (" (kept)" if keep_loops else " (cut to one copy)") + (f"; {left} left: run again to continue" if left else ""))
    return summary


def main(argv=None) -> int:
    """The command; the --out lock it takes is given back however it ends."""
    from export.io import release_output_locks

    try:
        return _main(argv)
    finally:
        release_output_locks()


def _main(argv=None) -> int:
    from inference.cli import CliError, Parser, add_kernel_flags, check_new_tokens_fit, check_output_folder, \
        check_ranges, kernel_settings, not_negative, positive, resolve_device

    ap = Parser(prog="python -m inference.regenerate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct", help="zoo name, HF folder, GGUF file or hub id")
    ap.add_argument("--dataset", default="sharegpt",
                    help="zoo name (sharegpt; mt-bench or humaneval: their questions), ShareGPT JSON or OpenAI-messages JSONL")
    ap.add_argument("--out", required=True, help="output folder (conversations.jsonl); re-run to resume")
    ap.add_argument("--limit", type=int, default=None, help="first N usable conversations of the source (unset: all)")
    ap.add_argument("--batch-size", type=int, default=None, help="conversations per batch (default 64 on GPU, 4 on CPU)")
    ap.add_argument("--max-new-tokens", type=int, default=512, help="tokens per answer at most")
    ap.add_argument("--max-length", type=int, default=2048, help="stop a conversation once a turn would pass this")
    ap.add_argument("--max-minutes", type=float, default=None, help="stop cleanly after the batch that passes this")
    ap.add_argument("--keep-loops", action="store_true", help="keep answers that end in a repetition loop whole")
    ap.add_argument("--shard", default="0/1", help="I/N: answer only the conversations whose index is I modulo N")
    ap.add_argument("--continue-from", default=None, help="an earlier run's conversations.jsonl (same settings): "
                    "its conversations are kept and not answered again")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy answers; > 0: answers sampled at this temperature (for the promise at T: "
                         "eval.sampled_answers)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampled answers")
    ap.add_argument("--heldout-only", type=float, default=None, metavar="FRACTION",
                    help="only the conversations training holds out at this data.heldout_fraction (e.g. 0.02)")
    ap.add_argument("--device", default=None, help="auto, cpu or cuda[:N] (unset: auto)")
    add_kernel_flags(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from data.sources import DataError
    from models.zoo import AssetError

    try:
        check_ranges(args, {"batch_size": positive, "max_new_tokens": positive, "max_length": positive, "limit": positive,
                            "max_minutes": positive, "temperature": not_negative, "heldout_only": positive})
        if args.heldout_only is not None and args.heldout_only >= 1:
            raise CliError(f"--heldout-only {args.heldout_only:g}: a fraction below 1 (training's data.heldout_fraction)")
        args.device = resolve_device(args.device)
        kernels = kernel_settings(args, args.device)
        check_output_folder(args.out, flag="--out", tool="regenerate", replaces=False)
        if args.continue_from and not Path(args.continue_from).is_file():
            raise CliError(f"--continue-from {args.continue_from}: not a file")
        check_new_tokens_fit(args.target, args.max_new_tokens)
        if args.max_new_tokens >= args.max_length:
            raise CliError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in --max-length {args.max_length}")
        from models.zoo import target_context_length

        context = target_context_length(args.target)
        if context is not None and args.max_length > context:  # prompt + answer beyond it would decode garbage
            raise CliError(f"--max-length {args.max_length} is beyond the target's context window of {context} tokens")
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        shard = tuple(int(x) for x in args.shard.split("/"))
        if len(shard) != 2 or not 0 <= shard[0] < shard[1]:
            raise ValueError
    except ValueError:
        print(f"error: --shard must be I/N with 0 <= I < N, got {args.shard!r}", file=sys.stderr)
        return 2
    batch = args.batch_size or (64 if args.device.startswith("cuda") else 4)
    try:
        regenerate(args.target, args.dataset, Path(args.out), args.limit, batch, args.max_new_tokens,
                   args.max_length, args.max_minutes, args.device, keep_loops=args.keep_loops, shard=shard,
                   continue_from=Path(args.continue_from) if args.continue_from else None,
                   temperature=args.temperature, seed=args.seed, heldout_only=args.heldout_only, kernels=kernels)
    except (DataError, AssetError, ValueError, OSError, KeyError) as e:
        print(f"error: {str(e).strip(chr(39))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: finished batches are saved; run the same command again to continue", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
