"""Read any export draftsmith writes back into its module: the layout modules of the method
table (export/formats.py) are asked in turn whether config.json is theirs."""
from __future__ import annotations

import json
from pathlib import Path

import torch

READERS = {"Eagle3DraftModel": "speculators", "LlamaForCausalLMEagle3": "sglang", "LlamaForCausalLMEagle": "eagle",
           "EagleLlamaForCausalLM": "eagle-vllm",
           "MedusaModel": "medusa", "DFlashDraftModel": "dflash (z-lab) or speculators (with speculators_model_type)",
           "Qwen3DSparkModel": "dspark, or speculators (with speculators_model_type dspark)"}


def _layout_of(config: dict, where):
    from export.formats import layout_modules

    for layout in layout_modules():
        if layout.reads(config):
            return layout
    arch = (config.get("architectures") or [None])[0]
    raise ValueError(f"{where}: architecture {arch!r} has no reader ({', '.join(READERS)})")


def load_export(folder: str | Path, dtype: torch.dtype = torch.float32, served: bool = False, check_hash: bool = True):
    """served: build the drafter from config.json alone, with the defaults a server takes for
    absent keys, ignoring draftsmith.json's drafter config (what export.check compares).
    check_hash: refuse weights that are not the ones draftsmith.json records (export.check
    reports that as one problem among others instead: weights_hash_problem)."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} is not an export folder (no config.json)")
    from export.io import read_json

    config = read_json(config_path)  # the readers below parse these again: a corrupt file is named here first
    meta = read_json(folder / "draftsmith.json") if (folder / "draftsmith.json").is_file() else {}
    layout = _layout_of(config, config_path)
    from safetensors import SafetensorError

    try:
        check_weights(folder, meta if isinstance(meta, dict) else {}, check_hash)
        return layout.read(folder, dtype=dtype, served=served)
    except SafetensorError as e:  # a 0-byte or truncated model.safetensors
        raise ValueError(f"{folder}/model.safetensors: not a readable safetensors file ({str(e).splitlines()[0][:160]}); "
                         "the export is truncated or corrupt: export it again") from None


# integer tensors an export carries on purpose: the draft vocabulary's maps ([Vd] int64, [V] bool; Medusa: token_map [Vd])
INTEGER_TENSORS = ("d2t", "t2d", "token_map")


def weights_hash_problem(folder: Path, meta: dict) -> str | None:
    """model.safetensors against draftsmith.json's `weights_sha256` (when it records one)."""
    import hashlib

    weights = Path(folder) / "model.safetensors"
    recorded = meta.get("weights_sha256")
    if not recorded or not weights.is_file():
        return None
    h = hashlib.sha256()
    with open(weights, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    if h.hexdigest() == recorded:
        return None
    return (f"{weights}: its sha256 {h.hexdigest()[:16]} is not the {str(recorded)[:16]} draftsmith.json records (the "
            "weights were changed or damaged after export); export it again")


def check_weights(folder: Path, meta: dict, check_hash: bool = True) -> None:
    """The export's weights are the ones it recorded and can be served: model.safetensors hashes
    to draftsmith.json's `weights_sha256` (when it records one), and every tensor but the vocab
    maps is floating point and finite. ValueError naming the file and tensor otherwise (a reader
    would cast integers silently, and a NaN drafts garbage that validation may still pass)."""
    from safetensors import safe_open

    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if name.rsplit(".", 1)[-1] in INTEGER_TENSORS:
                    continue
                if not tensor.is_floating_point():
                    raise ValueError(f"{path}: tensor {name} is {str(tensor.dtype).removeprefix('torch.')}, not floating "
                                     "point; refusing to serve it")
                if not bool(torch.isfinite(tensor).all()):
                    raise ValueError(f"{path}: tensor {name} holds NaN or Inf values; refusing to serve it")
    problem = weights_hash_problem(folder, meta) if check_hash else None  # (after: a truncated file is named as one)
    if problem:
        raise ValueError(problem)


def served_config(folder: str | Path):
    """The drafter config a server builds from the folder's config.json alone (with its
    defaults for absent keys), whether or not the tensors then load: export.check compares it
    field by field with the trained drafter's."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    return _layout_of(config, f"{folder}/config.json").served_config(config, folder)


def check_target(folder: str | Path, target_path: str | Path, accept_other: bool = False) -> str | None:
    """The target an export is served with is the one it was trained against: draftsmith.json's
    target_weights_sha256 (models.checkpoint.target_weights_hash) against the served target's.
    Another target is refused (ValueError) unless `accept_other`; then the returned line says so
    (None when they agree, or when the export records no hash)."""
    from export.io import read_json
    from models.checkpoint import target_weights_hash

    meta_path = Path(folder) / "draftsmith.json"
    meta = read_json(meta_path) if meta_path.is_file() else {}
    recorded = meta.get("target_weights_sha256") if isinstance(meta, dict) else None
    found = target_weights_hash(target_path) if recorded else None
    if not recorded or found is None or found == recorded:
        return None
    what = (f"target {target_path}: its weights hash {found[:16]} is not the {str(recorded)[:16]} the drafter in {folder} "
            "was trained against")
    if not accept_other:
        raise ValueError(f"{what}; pass --accept-other-target to serve it with this target anyway")
    return f"{what}; served anyway (--accept-other-target)"
