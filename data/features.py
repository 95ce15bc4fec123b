"""The feature store: the target's outputs over a training set, written once by
`python -m train.extract` and read by training (`data.features=DIR`) instead of running the target.

A store is a folder:
  manifest.json       what it was made from (target weights hash, layers, data fingerprint, draft
                      vocabulary) and how it is stored (dtype, top-k, compression), its shards
  shard-NNNNN.parquet one row per training conversation, in the order of the tokenized training
                      split (column `index`), readable with `datasets.load_dataset("parquet", ...)`
  .draftsmith-output.json  the marker of draftsmith's output (tool "extract")

Columns of a row (T tokens; W = the stored feature's width; k = top-k):
  index int64; input_ids list<int32>[T]; loss_mask list<int8>[T]; greedy list<int32>[T] (the
  target's argmax over its full vocabulary);
  `aux` [T][W] (the aux layers concatenated, EAGLE-3 / DFlash) and/or `last_hidden` [T][W] (the
  final normed hidden state, EAGLE-1 / Medusa / MTP): float32, bf16 bits as uint16, or FP8 e4m3
  bits as uint8 with `<field>_scale` [T][n] float32 (one scale per token and layer);
  teacher_ids [T][k] (rows of the draft vocabulary) and teacher_logprobs [T][k]: the top-k of the
  target's log-probabilities over the draft vocabulary (k = Vd: all of it, exactly the online
  teacher), float32 in a float32 store, float16 otherwise.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

FORMAT = "draftsmith-features"
VERSION = 1
MANIFEST = "manifest.json"
DTYPES = ("float32", "bf16", "fp8-e4m3")
COMPRESSIONS = ("zstd", "none")
FIELDS = ("aux", "last_hidden")
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class StoreError(ValueError):
    """A feature store that cannot be used for this run (one line naming why)."""


# ------------------------------------------------------------------------ what a method reads
def needed_fields(drafter, feature_regression: bool) -> list[str]:
    """The TargetOutput fields `drafter.features` (and `feature_targets` when the objective
    regresses features) read: each is called on an output whose fields are their own names."""
    from models.target import TargetOutput

    probe = TargetOutput(aux="aux", last_hidden="last_hidden")
    calls = [drafter.features] + ([drafter.feature_targets] if feature_regression else [])
    fields = []
    for call in calls:
        got = call(probe)
        if got not in FIELDS:
            raise StoreError(f"{type(drafter).__name__}.features reads a computed value, not a field of the target's "
                             "output; it cannot train from a feature store")
        if got not in fields:
            fields.append(got)
    return fields


# ------------------------------------------------------------------------ quantisation
def fp8_quantise(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, n*H] → (e4m3 bits [T, n*H] uint8, scale [T, n] float32): each token's row of each of
    the n layers scaled so its largest magnitude maps to 448 (e4m3's largest finite value)."""
    T, W = x.shape
    rows = x.float().view(T, groups, W // groups)
    scale = (rows.abs().amax(-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)  # [T, n]
    q = (rows / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).view(T, W), scale


def fp8_dequantise(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(uint8 bits [T, n*H], scale [T, n]) → float32 [T, n*H]."""
    T, W = bits.shape
    n = scale.shape[-1]
    rows = bits.contiguous().view(torch.float8_e4m3fn).float().view(T, n, W // n)
    return (rows * scale[..., None]).view(T, W)


def fp8_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The largest |x - dequantised x| round-to-nearest e4m3 allows, elementwise: half a unit
    in the last place, 2^-4 |x| for normal numbers (3 mantissa bits), 2^-10 * scale below
    e4m3's smallest normal 2^-6 (subnormal spacing 2^-9)."""
    T, W = x.shape
    n = scale.shape[-1]
    s = scale.repeat_interleave(W // n, dim=-1)
    return torch.maximum(x.float().abs() * 2.0**-4, s * 2.0**-10)


def encode(x: torch.Tensor, dtype: str, groups: int) -> dict:
    """A feature tensor [T, W] as numpy arrays in the store's dtype: {"values": [T, W], "scale": [T, n]?}."""
    if dtype == "float32":
        return {"values": x.float().cpu().numpy()}
    if dtype == "bf16":
        return {"values": x.to(torch.bfloat16).cpu().view(torch.int16).numpy().view(np.uint16)}
    bits, scale = fp8_quantise(x, groups)
    return {"values": bits.cpu().numpy(), "scale": scale.cpu().numpy()}


def decode(values: np.ndarray, scale: np.ndarray | None, dtype: str) -> torch.Tensor:
    """The inverse of `encode`: float32 for float32 and FP8 stores, bfloat16 for a bf16 store."""
    t = torch.from_numpy(np.array(values))  # (a copy: arrow's buffers are read-only)
    if dtype == "float32":
        return t
    if dtype == "bf16":
        return t.view(torch.int16).view(torch.bfloat16)
    return fp8_dequantise(t, torch.from_numpy(np.array(scale)))


# ------------------------------------------------------------------------ fingerprints
def data_fingerprint(train) -> str:
    """sha256 of a tokenized training split (a `datasets.Dataset`): its rows' token ids and loss
    masks, in order. The same data, template, tokenizer and max_length give the same one."""
    h = hashlib.sha256()
    for name in ("input_ids", "loss_mask"):
        column = train.data.column(name).combine_chunks()
        h.update(name.encode())
        h.update(np.asarray(column.offsets).astype(np.int64).tobytes())
        h.update(np.asarray(column.values).astype(np.int64).tobytes())
    return h.hexdigest()


def vocab_fingerprint(d2t: torch.Tensor) -> str:
    """sha256 of the draft vocabulary map d2t [Vd]."""
    return hashlib.sha256(d2t.to(torch.int64).numpy().tobytes()).hexdigest()


# ------------------------------------------------------------------------ files
def shard_name(i: int) -> str:
    return f"shard-{i:05d}.parquet"


def write_shard(path: Path, rows: list[dict], fields: list[str], dtype: str, compression: str) -> int:
    """Rows ({"index", "input_ids", "loss_mask", "greedy", field: encode(...), "teacher_ids",
    "teacher_logprobs"}) as one parquet file, written to a temporary sibling and renamed: a
    killed writer leaves no file under the shard's name. Returns its size in bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def nested(arrays: list[np.ndarray]):  # [T_i, w] per row → list<fixed_size_list<w>>
        width = arrays[0].shape[1]
        flat = pa.array(np.concatenate([a.reshape(-1) for a in arrays]))
        offsets = pa.array(np.cumsum([0] + [a.shape[0] for a in arrays]).astype(np.int32))
        return pa.ListArray.from_arrays(offsets, pa.FixedSizeListArray.from_arrays(flat, width))

    def flat_list(arrays, np_dtype):
        values = pa.array(np.concatenate([np.asarray(a, dtype=np_dtype) for a in arrays]))
        offsets = pa.array(np.cumsum([0] + [len(a) for a in arrays]).astype(np.int32))
        return pa.ListArray.from_arrays(offsets, values)

    columns = {"index": pa.array([r["index"] for r in rows], type=pa.int64()),
               "input_ids": flat_list([r["input_ids"] for r in rows], np.int32),
               "loss_mask": flat_list([r["loss_mask"] for r in rows], np.int8),
               "greedy": flat_list([r["greedy"] for r in rows], np.int32)}
    for f in fields:
        columns[f] = nested([r[f]["values"] for r in rows])
        if dtype == "fp8-e4m3":
            columns[f"{f}_scale"] = nested([r[f]["scale"] for r in rows])
    columns["teacher_ids"] = nested([r["teacher_ids"] for r in rows])
    columns["teacher_logprobs"] = nested([r["teacher_logprobs"] for r in rows])
    table = pa.table(columns)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        # a row group per conversation: training reads conversations in a shuffled order, each by
        # its own row group, never a whole shard
        pq.write_table(table, tmp, compression=None if compression == "none" else compression, row_group_size=1)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # (mkstemp makes it private; a store is for sharing)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path.stat().st_size


def read_manifest(folder: Path) -> dict | None:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None


# ------------------------------------------------------------------------ the run's check
@dataclass
class Expected:
    """What a training run needs of a store (from its config, target and tokenized data)."""

    target: str
    weights_sha256: str | None
    layers: list[int]
    fields: list[str]
    data_fingerprint: str
    dataset: str
    vocab_fingerprint: str
    draft_vocab_size: int


def check_store(folder: str, expected: Expected) -> dict:
    """The store's manifest when it fits the run; else StoreError, one line naming the mismatch."""
    where = f"data.features: {folder}"
    try:
        return _check_store(folder, expected, where)
    except (KeyError, TypeError) as e:  # a manifest edited or written by something else
        raise StoreError(f"{where}: {MANIFEST} is malformed (no {e} where a store has one); extract it again") from None


def _check_store(folder: str, expected: Expected, where: str) -> dict:
    if not Path(folder).is_dir():
        raise StoreError(f"{where} does not exist (write it with python -m train.extract)")
    m = read_manifest(Path(folder))
    if m is None:
        raise StoreError(f"{where} is not a feature store (no {MANIFEST} written by python -m train.extract)")
    if m.get("version") != VERSION:
        raise StoreError(f"{where} is a version {m.get('version')} store; this draftsmith reads version {VERSION}")
    if not m.get("complete"):
        done, total = len(m.get("shards", [])), m.get("num_shards", "?")
        raise StoreError(f"{where} is an unfinished extraction ({done} of {total} shards); run the same "
                         "python -m train.extract again to finish it")
    t = m["target"]
    # (a target without safetensors files has no weights hash: its name is compared instead)
    if t.get("weights_sha256") != expected.weights_sha256 or (expected.weights_sha256 is None and t.get("name") != expected.target):
        raise StoreError(f"{where} was extracted from another target ({t.get('name')}, weights sha256 "
                         f"{str(t.get('weights_sha256'))[:12]}), not this run's {expected.target} "
                         f"({str(expected.weights_sha256)[:12]})")
    missing = [f for f in expected.fields if f not in m["fields"]]
    if missing:
        raise StoreError(f"{where} stores {', '.join(m['fields'])} (method {m.get('method')}), but this run's drafter "
                         f"reads {', '.join(missing)}; extract for drafter.method of this run")
    if "aux" in expected.fields and list(m["layers"]) != list(expected.layers):
        raise StoreError(f"{where} holds target layers {m['layers']}, not this run's drafter.aux_layer_ids "
                         f"{expected.layers}")
    if m["data"]["fingerprint"] != expected.data_fingerprint:
        raise StoreError(f"{where} holds other data ({m['data']['dataset']}, {m['data']['conversations']} conversations, "
                         f"fingerprint {m['data']['fingerprint'][:12]}) than this run's {expected.dataset} "
                         f"(fingerprint {expected.data_fingerprint[:12]}): same data.* settings and target tokenizer needed")
    if m["draft_vocab"]["fingerprint"] != expected.vocab_fingerprint:
        raise StoreError(f"{where} was extracted for another draft vocabulary ({m['draft_vocab']['size']} tokens) than "
                         f"this run's ({expected.draft_vocab_size}): same drafter.draft_vocab_size needed")
    # every shard the manifest lists, whole (its size as written), before a run folder is made
    if len(m["shards"]) != m["num_shards"]:
        raise StoreError(f"{where} lists {len(m['shards'])} shards of {m['num_shards']}; extract it again")
    for shard in m["shards"]:
        path = Path(folder) / shard["file"]
        size = path.stat().st_size if path.is_file() else None
        if size != shard["bytes"]:
            raise StoreError(f"{where}: {shard['file']} is " + ("missing" if size is None else
                             f"{size} bytes, not the {shard['bytes']} written") + "; extract the store again")
    return m


# ------------------------------------------------------------------------ reading for training
class StoreDataset:
    """The training split read from a store, indexable as the tokenized split is (row i = its
    row i): what ChatDataModule's sampler and loader use (`num_tokens`, len, items, collate).
    Each conversation is read alone (a row group of its shard: train.extract writes one per
    conversation), so a shuffled order reads no more than it uses."""

    def __init__(self, folder: str, manifest: dict, num_tokens: list[int], pad_id: int):
        self.folder, self.manifest, self.pad_id = Path(folder), manifest, pad_id
        self.num_tokens = list(num_tokens)
        self.fields, self.dtype = manifest["fields"], manifest["dtype"]
        self.shard_rows = [s["rows"] for s in manifest["shards"]]
        self.starts = np.cumsum([0] + self.shard_rows)
        self._files: dict = {}  # shard number → its open pyarrow ParquetFile

    def __len__(self):
        return len(self.num_tokens)

    def __getitem__(self, key):
        if key == "num_tokens":
            return self.num_tokens
        if not isinstance(key, (int, np.integer)):
            raise KeyError(key)
        s = int(np.searchsorted(self.starts, key, side="right") - 1)
        r = int(key) - int(self.starts[s])
        row = self._row(s, r)
        if row["index"] != int(key):
            raise StoreError(f"{self.folder}: shard {s} row {r} holds conversation {row['index']}, not {key}")
        return row

    def __getstate__(self):  # (DataLoader workers started by spawn: open files are not sent)
        return {**self.__dict__, "_files": {}}

    def _row(self, s: int, r: int) -> dict:
        """Row r of shard s (its own row group) as numpy arrays: [T] columns, [T, width] ones."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        if s not in self._files:
            f = pq.ParquetFile(self.folder / self.manifest["shards"][s]["file"])
            if f.metadata.num_row_groups != self.shard_rows[s]:
                raise StoreError(f"{self.folder}: shard {s} is not one row group per conversation; extract it again")
            self._files[s] = f
        table = self._files[s].read_row_group(r)
        row = {"index": int(table.column("index")[0].as_py())}
        for name in table.column_names:
            if name == "index":
                continue
            values = table.column(name).combine_chunks().flatten()  # the row's [T] list, flattened one level
            if pa.types.is_fixed_size_list(values.type):
                row[name] = values.flatten().to_numpy(zero_copy_only=False).reshape(-1, values.type.list_size)
            else:
                row[name] = values.to_numpy(zero_copy_only=False)
        return row

    def collate(self, rows: list[dict], multiple: int = 128) -> dict:
        """Right-padded as data.module.collate pads (T rounded up to `multiple`): input_ids,
        loss_mask, lengths, num_tokens as there, and the stored target outputs: <field> [B,T,W]
        (float32, or bfloat16 from a bf16 store), greedy [B,T], teacher_ids / teacher_logprobs
        [B,T,k] (padding: id 0 at log-prob -inf, so it adds no probability)."""
        T = -(-max(len(r["input_ids"]) for r in rows) // multiple) * multiple
        B = len(rows)
        k = rows[0]["teacher_ids"].shape[1]
        batch = {"input_ids": torch.full((B, T), self.pad_id, dtype=torch.long),
                 "loss_mask": torch.zeros((B, T), dtype=torch.long),
                 "greedy": torch.zeros((B, T), dtype=torch.long),
                 "teacher_ids": torch.zeros((B, T, k), dtype=torch.long),
                 "teacher_logprobs": torch.full((B, T, k), float("-inf"), dtype=torch.float32)}
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            batch["input_ids"][i, :n] = torch.from_numpy(r["input_ids"].astype(np.int64))
            batch["loss_mask"][i, :n] = torch.from_numpy(r["loss_mask"].astype(np.int64))
            batch["greedy"][i, :n] = torch.from_numpy(r["greedy"].astype(np.int64))
            batch["teacher_ids"][i, :n] = torch.from_numpy(r["teacher_ids"].astype(np.int64))
            batch["teacher_logprobs"][i, :n] = torch.from_numpy(r["teacher_logprobs"].astype(np.float32))
        for f in self.fields:
            decoded = [decode(r[f], r.get(f"{f}_scale"), self.dtype) for r in rows]
            out = torch.zeros((B, T, decoded[0].shape[1]), dtype=decoded[0].dtype)
            for i, d in enumerate(decoded):
                out[i, : d.shape[0]] = d
            batch[f] = out
        lengths = [len(r["input_ids"]) for r in rows]
        batch["lengths"] = torch.tensor(lengths)
        batch["num_tokens"] = sum(lengths)
        return batch


def stored_teacher(teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor, vd: int, dtype) -> torch.Tensor:
    """Teacher probabilities [B,T,Vd] from the stored top-k (ids [B,T,k], log-probs [B,T,k]),
    renormalised over the k kept (k = Vd: the online teacher, to float32 round-off)."""
    p = teacher_logprobs.float().exp()
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    dense = torch.zeros(*teacher_ids.shape[:-1], vd, dtype=torch.float32, device=teacher_ids.device)
    return dense.scatter_(-1, teacher_ids, p).to(dtype)


def open_for_run(cfg, target_path, train, d2t: torch.Tensor, drafter, pad_id: int) -> StoreDataset:
    """The store of `cfg.data.features` checked against this run (StoreError naming the mismatch)
    and opened over the training split `train`."""
    from models.checkpoint import target_weights_hash
    from models.methods import method

    if cfg.objective.joint:
        raise StoreError("data.features: joint training (objective.joint) trains the target, so it cannot train from "
                         "stored features; drop data.features or objective.joint")
    fields = needed_fields(drafter, cfg.objective.feature_weight > 0 and method(cfg.drafter.method).feature_regression)
    expected = Expected(target=cfg.target, weights_sha256=target_weights_hash(target_path), layers=list(drafter.aux_layer_ids),
                        fields=fields, data_fingerprint=data_fingerprint(train), dataset=cfg.data.dataset,
                        vocab_fingerprint=vocab_fingerprint(d2t), draft_vocab_size=d2t.numel())
    manifest = check_store(cfg.data.features, expected)
    return StoreDataset(cfg.data.features, manifest, list(train["num_tokens"]), pad_id)
