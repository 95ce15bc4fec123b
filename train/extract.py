"""python -m train.extract --config RECIPE [dotted.key=value ...] --out DIR [--dtype float32|bf16|fp8-e4m3] [--topk K]

Runs the recipe's target once over its training data (the same tokenized split, chat rendering,
loss masks and draft vocabulary as `python -m train` with that recipe) and writes a feature store
(data/features.py): per conversation, the features the recipe's method reads and the target's
teacher signal. Training from it: `python -m train --config RECIPE data.features=DIR`.

Resumable: shards are planned from the data before the first is written (cut at conversation
boundaries every --shard-tokens tokens) and each is written whole then renamed, so a killed run
started again with the same command skips the shards on disk and continues with the next.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from data import features as fs

log = logging.getLogger("draftsmith")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m train.extract", description="Extract a target's features once, to train drafters from.",
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=None, help="YAML recipe, as python -m train takes it (unset: configs/quickstart.yaml)")
    p.add_argument("--out", required=True, help="the store's folder (new, or an unfinished extraction of the same settings)")
    p.add_argument("--dtype", default="bf16", choices=fs.DTYPES,
                   help="features stored as float32, bf16, or FP8 e4m3 with a scale per token and layer")
    p.add_argument("--topk", type=int, default=64,
                   help="teacher log-probabilities kept per token over the draft vocabulary (0: all of it, the exact teacher)")
    p.add_argument("--compression", default="zstd", choices=fs.COMPRESSIONS, help="parquet compression of the shards")
    p.add_argument("--shard-tokens", type=int, default=65536, help="tokens per shard (cut at conversation boundaries)")
    p.add_argument("--batch-size", type=int, default=None, help="conversations per target pass (default: data.batch_size)")
    p.add_argument("--device", default="auto", help="where the target runs: auto (cuda if there is one), cpu, cuda, cuda:N")
    p.add_argument("--device-map", default=None,
                   help="spread the target over several devices with accelerate (e.g. auto: every visible GPU); "
                        "--device is then where the outputs are gathered")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides of the recipe")
    return p


# ------------------------------------------------------------------------------ the target pass
class _GatheringTarget:
    """models.target.Target whose captured layers are moved to one device as they come (a target
    spread over devices by a device map has its layers on several)."""

    @staticmethod
    def make(model, layers: list[int], device: torch.device):
        from models.target import Target

        class Gathering(Target):
            def _capture(self, i):
                def hook(_module, _inputs, output):
                    self._captured[i] = (output[0] if isinstance(output, tuple) else output).to(device)
                return hook

        return Gathering(model, layers)


@torch.no_grad()
def head_signal(target, last_hidden: torch.Tensor, draft_ids: torch.Tensor, k: int, chunk_rows: int = 2048):
    """The teacher signal the training step reads, from the final hidden state [N, H]:
    (greedy [N] over the full vocabulary, top-k ids [N, k] into the draft vocabulary, their
    log-probabilities [N, k] float32 under the softmax over the draft vocabulary), computed from
    the same logits as Target.head_outputs."""
    W = target.head_weight
    cap = getattr(target.config, "final_logit_softcapping", None)
    h = last_hidden.to(W.device)
    ids = draft_ids.to(W.device)
    greedy, top_ids, top_lp = [], [], []
    for start in range(0, h.shape[0], chunk_rows):
        logits = F.linear(h[start : start + chunk_rows], W)  # [rows, V]
        if cap:
            logits = torch.tanh(logits / cap) * cap
        greedy.append(logits.argmax(-1))
        lp = torch.log_softmax(logits[:, ids].float(), -1)  # [rows, Vd]
        vals, idx = lp.topk(k, dim=-1)
        top_ids.append(idx)
        top_lp.append(vals)
    return torch.cat(greedy), torch.cat(top_ids), torch.cat(top_lp)


def plan_shards(num_tokens: list[int], shard_tokens: int) -> list[tuple[int, int]]:
    """[start, end) conversation ranges of about `shard_tokens` tokens each (at least one conversation)."""
    shards, start, total = [], 0, 0
    for i, n in enumerate(num_tokens):
        total += n
        if total >= shard_tokens:
            shards.append((start, i + 1))
            start, total = i + 1, 0
    if start < len(num_tokens):
        shards.append((start, len(num_tokens)))
    return shards


# ------------------------------------------------------------------------------ the command
def extract(cfg, out: str, dtype: str = "bf16", topk: int = 64, compression: str = "zstd", shard_tokens: int = 65536,
            batch_size: int | None = None, device: str = "auto", device_map: str | None = None, progress: bool = True,
            stop_after_shards: int | None = None) -> dict:
    """Write (or finish) the store of run config `cfg` into `out`; returns its manifest.
    stop_after_shards: stop with RuntimeError once that many shards were written by this call
    (how the tests kill an extraction at a known point)."""
    from transformers import AutoConfig, AutoTokenizer

    from data.templates import apply_template_choice
    from export.io import atomic_write_json, output_lock, release_output_lock
    from export.paths import check_writable, read_marker, write_marker
    from models.checkpoint import target_weights_hash
    from models.draft_vocab import draft_ids as draft_ids_of
    from models.zoo import resolve_target
    from train.config import ConfigError
    from train.run import _mask_token, build_drafter, prepare_data

    if cfg.objective.joint:
        raise ConfigError("objective.joint: joint training trains the target, so it cannot train from stored features")
    if topk < 0 or shard_tokens < 1 or (batch_size is not None and batch_size < 1):
        raise ConfigError("--topk must be >= 0, --shard-tokens and --batch-size >= 1")
    out_dir = Path(out)
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and (read_marker(out_dir) or {}).get("tool")
                                                       != "extract")):
        raise ConfigError(f"--out: {out_dir} exists and is not a feature store python -m train.extract wrote; "
                          "refusing to write into it (choose a new folder)")
    check_writable(out_dir, "--out")  # (under a file, or in a folder we cannot write in: one line, before any work)
    try:
        run_device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                  ("cpu" if device == "auto" else device))
    except RuntimeError:
        raise ConfigError(f"--device: {device!r} is not a device (auto, cpu, cuda, cuda:N)") from None
    if run_device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device: {device} asked for, but this machine has no CUDA GPU")
    on_gpu = run_device.type == "cuda"  # (the target's dtype follows training's rule: bf16 on a GPU)
    target_dtype = torch.bfloat16 if cfg.target_dtype == "auto" and on_gpu else \
        (torch.float32 if cfg.target_dtype == "auto" else getattr(torch, cfg.target_dtype))

    target_path = resolve_target(cfg.target)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    apply_template_choice(tokenizer, cfg.data.chat_template, cfg.data.plain_text, cfg.target)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    hf_config = AutoConfig.from_pretrained(target_path)
    train, _, d2t, _ = prepare_data(cfg, tokenizer, hf_config.vocab_size)  # the training run's split and draft vocab
    drafter = build_drafter(cfg, hf_config, d2t.numel(), mask_token_id=_mask_token(cfg, tokenizer))
    from models.methods import method

    fields = fs.needed_fields(drafter, cfg.objective.feature_weight > 0 and method(cfg.drafter.method).feature_regression)
    vd = d2t.numel()
    k = vd if topk == 0 else min(topk, vd)
    num_tokens = list(train["num_tokens"])
    shards = plan_shards(num_tokens, shard_tokens)
    settings = {
        "format": fs.FORMAT, "version": fs.VERSION, "method": cfg.drafter.method,
        "target": {"name": cfg.target, "weights_sha256": target_weights_hash(target_path), "dtype": str(target_dtype)[6:],
                   "num_layers": hf_config.num_hidden_layers, "hidden_size": hf_config.hidden_size,
                   "vocab_size": hf_config.vocab_size},
        "layers": list(drafter.aux_layer_ids), "fields": fields, "dtype": dtype,
        "teacher": {"topk": k, "over": "draft vocabulary", "logprobs_dtype": "float32" if dtype == "float32" else "float16",
                    "exact": k == vd},
        "compression": compression,
        "data": {"dataset": cfg.data.dataset, "fingerprint": fs.data_fingerprint(train), "conversations": len(train),
                 "tokens": sum(num_tokens), "max_length": cfg.data.max_length, "limit": cfg.data.limit,
                 "heldout_fraction": cfg.data.heldout_fraction, "plain_text": cfg.data.plain_text,
                 "chat_template": cfg.data.chat_template},
        "draft_vocab": {"size": vd, "fingerprint": fs.vocab_fingerprint(d2t)},
        "shard_tokens": shard_tokens, "num_shards": len(shards),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    took = output_lock(out_dir)
    try:
        return _extract_locked(out_dir, settings, shards, train, num_tokens, target_path, target_dtype, run_device,
                               device_map, pad_id, draft_ids_of(d2t), k, fields, batch_size or cfg.data.batch_size,
                               progress, stop_after_shards, atomic_write_json, write_marker)
    finally:
        if took:
            release_output_lock(out_dir)


def _extract_locked(out_dir, settings, shards, train, num_tokens, target_path, target_dtype, run_device, device_map,
                    pad_id, draft_ids, k, fields, batch_size, progress, stop_after_shards, atomic_write_json, write_marker):
    from train.config import ConfigError

    old = fs.read_manifest(out_dir)
    if old is not None:
        changed = [key for key in settings if old.get(key) != settings[key]]
        if changed:
            raise ConfigError(f"--out: {out_dir} holds a store of other settings ({', '.join(changed)} differ); "
                              "choose a new folder")
    for stale in out_dir.glob(".shard-*.parquet.*"):  # a killed writer's temporary file (we hold the lock)
        stale.unlink(missing_ok=True)
    done = {s["file"]: s for s in (old or {}).get("shards", []) if (out_dir / s["file"]).is_file()}
    manifest = {**settings, "complete": False, "shards": [done[f] for f in sorted(done)]}
    write_marker(out_dir, "extract", [fs.MANIFEST] + [fs.shard_name(i) for i in range(len(shards))])
    atomic_write_json(out_dir / fs.MANIFEST, manifest)
    todo = [i for i in range(len(shards)) if fs.shard_name(i) not in done]
    if todo:
        target = _load_target(target_path, settings["layers"], target_dtype, run_device, device_map)
    from tqdm import tqdm

    done_tokens = sum(s["tokens"] for s in done.values())
    t0, written = time.time(), 0
    with tqdm(total=settings["data"]["tokens"], initial=done_tokens, unit="tok", unit_scale=True, desc="extracting",
              disable=not progress, smoothing=0.1) as bar:
        for i in todo:
            start, end = shards[i]
            rows = _shard_rows(target, train, range(start, end), num_tokens, pad_id, draft_ids, k, fields,
                               settings["dtype"], batch_size, run_device, bar)
            size = fs.write_shard(out_dir / fs.shard_name(i), rows, fields, settings["dtype"], settings["compression"])
            manifest["shards"] = sorted(manifest["shards"] + [{"file": fs.shard_name(i), "rows": end - start,
                                                               "tokens": sum(num_tokens[start:end]), "bytes": size}],
                                        key=lambda s: s["file"])
            atomic_write_json(out_dir / fs.MANIFEST, manifest)
            written += 1
            if stop_after_shards is not None and written >= stop_after_shards and i != todo[-1]:
                raise RuntimeError(f"stopped after {written} shard(s), as asked")
    seconds = time.time() - t0
    manifest["complete"] = True
    manifest["bytes_per_token"] = bytes_per_token(out_dir, manifest)
    manifest["extraction"] = {"device": str(run_device) if device_map is None else f"device_map={device_map}",
                              "seconds_this_run": round(seconds, 1),
                              "tokens_per_s_this_run": round((settings["data"]["tokens"] - done_tokens) / max(seconds, 1e-9), 1)}
    atomic_write_json(out_dir / fs.MANIFEST, manifest)
    return manifest


def _load_target(target_path, layers, dtype, device, device_map):
    from transformers import AutoModelForCausalLM

    from models.target import Target

    if device_map is None:
        model = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype).to(device)
        return Target(model.eval(), layers)
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype, device_map=device_map)
    return _GatheringTarget.make(model.eval(), layers, device)


@torch.no_grad()
def _shard_rows(target, train, indices, num_tokens, pad_id, draft_ids, k, fields, dtype, batch_size, device, bar):
    """One shard's rows (conversation order), from target passes over batches of similar length."""
    order = sorted(indices, key=lambda i: -num_tokens[i])
    rows = {}
    groups = {"aux": len(target.aux_layer_ids), "last_hidden": 1}
    for b in range(0, len(order), batch_size):
        batch = order[b : b + batch_size]
        convs = [train[i] for i in batch]
        T = max(len(c["input_ids"]) for c in convs)
        ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
        for j, c in enumerate(convs):
            ids[j, : len(c["input_ids"])] = torch.as_tensor(c["input_ids"])
        out = target(ids.to(target.model.get_input_embeddings().weight.device))
        last = out.last_hidden
        greedy, top_ids, top_lp = head_signal(target, last.reshape(-1, last.shape[-1]), draft_ids, k)
        greedy, top_ids, top_lp = (x.view(len(batch), T, -1).cpu() for x in (greedy, top_ids, top_lp))
        for j, (i, c) in enumerate(zip(batch, convs)):
            n = len(c["input_ids"])
            row = {"index": i, "input_ids": c["input_ids"], "loss_mask": c["loss_mask"], "greedy": greedy[j, :n, 0].numpy(),
                   "teacher_ids": top_ids[j, :n].to(torch.int16 if draft_ids.numel() <= 32768 else torch.int32).numpy(),
                   "teacher_logprobs": top_lp[j, :n].to(torch.float32 if dtype == "float32" else torch.float16).numpy()}
            for f in fields:
                x = (out.aux if f == "aux" else last)[j, :n].to(device)
                row[f] = fs.encode(x, dtype, groups[f])
            rows[i] = row
            bar.update(n)
    return [rows[i] for i in indices]


def bytes_per_token(out_dir: Path, manifest: dict) -> dict:
    """Bytes per token of the store on disk, by part (from the shards' parquet column sizes)."""
    import pyarrow.parquet as pq

    parts = {"features": 0, "teacher": 0, "tokens": 0}
    for s in manifest["shards"]:
        meta = pq.read_metadata(out_dir / s["file"])
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            for c in range(group.num_columns):
                col = group.column(c)
                name = col.path_in_schema.split(".")[0]
                part = "teacher" if name.startswith("teacher") else \
                    ("features" if name.split("_scale")[0] in fs.FIELDS else "tokens")
                parts[part] += col.total_compressed_size
    tokens = max(manifest["data"]["tokens"], 1)
    out = {part: round(n / tokens, 1) for part, n in parts.items()}
    out["total"] = round(sum(parts.values()) / tokens, 1)
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from data.sources import DataError
    from export.paths import OutputPathError
    from models.zoo import AssetError
    from train.__main__ import DEFAULT_CONFIG
    from train.config import ConfigError, load_config

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "datasets", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        cfg = load_config(args.config if args.config is not None else str(DEFAULT_CONFIG), args.overrides)
        m = extract(cfg, args.out, dtype=args.dtype, topk=args.topk, compression=args.compression,
                    shard_tokens=args.shard_tokens, batch_size=args.batch_size, device=args.device,
                    device_map=args.device_map)
    except (ConfigError, DataError, AssetError, OutputPathError, fs.StoreError) as e:
        print(f"error: {str(e).strip(chr(39))}", file=sys.stderr)
        return 2
    bpt, ex = m["bytes_per_token"], m["extraction"]
    print(f"wrote {args.out}: {m['data']['conversations']} conversations, {m['data']['tokens']} tokens in "
          f"{m['num_shards']} shards ({ex['tokens_per_s_this_run']:.0f} tokens/s this run on {ex['device']})")
    print(f"bytes per token: features {bpt['features']} ({m['dtype']}: {', '.join(m['fields'])}), teacher {bpt['teacher']} "
          f"(top-{m['teacher']['topk']} of {m['draft_vocab']['size']}), ids and mask {bpt['tokens']}; total {bpt['total']}")
    print(f"train from it: python -m train {'--config ' + args.config + ' ' if args.config else ''}"
          f"{' '.join(args.overrides) + ' ' if args.overrides else ''}data.features={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
