"""Read any export draftsmith writes back into its module, chosen by config.json's architecture."""
from __future__ import annotations

import json
from pathlib import Path

import torch

READERS = {"Eagle3DraftModel": "speculators", "LlamaForCausalLMEagle3": "sglang", "LlamaForCausalLMEagle": "eagle",
           "EagleLlamaForCausalLM": "eagle-vllm",
           "MedusaModel": "medusa", "DFlashDraftModel": "dflash (z-lab) or speculators (with speculators_model_type)"}


def load_export(folder: str | Path, dtype: torch.dtype = torch.float32, served: bool = False):
    """served: build the drafter from config.json alone, with the defaults a server takes for
    absent keys, ignoring draftsmith.json's drafter config (what export.check compares)."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} is not an export folder (no config.json)")
    from export.io import read_json

    config = read_json(config_path)  # the readers below parse these again: a corrupt file is named here first
    if (folder / "draftsmith.json").is_file():
        read_json(folder / "draftsmith.json")
    arch = (config.get("architectures") or [None])[0]
    if config.get("num_nextn_predict_layers"):
        from export.mtp import load_mtp

        return load_mtp(folder, dtype=dtype, served=served)
    if arch == "Eagle3DraftModel" or config.get("speculators_model_type") in ("eagle3", "dflash"):
        from export.speculators import load_speculators

        return load_speculators(folder, dtype=dtype, served=served)
    if arch == "LlamaForCausalLMEagle3":
        from export.sglang import load_sglang

        return load_sglang(folder, dtype=dtype, served=served)
    if arch in ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM"):
        from export.eagle1 import load_eagle1

        return load_eagle1(folder, dtype=dtype, served=served)
    if arch == "DFlashDraftModel":
        from export.dflash import load_dflash

        return load_dflash(folder, dtype=dtype, served=served)
    if arch == "MedusaModel":
        from export.medusa import load_medusa

        return load_medusa(folder, dtype=dtype, served=served)
    raise ValueError(f"{config_path}: architecture {arch!r} has no reader ({', '.join(READERS)})")


def served_config(folder: str | Path):
    """The drafter config a server builds from the folder's config.json alone (with its
    defaults for absent keys), whether or not the tensors then load: export.check compares it
    field by field with the trained drafter's."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    arch = (config.get("architectures") or [None])[0]
    if config.get("num_nextn_predict_layers"):
        from export.mtp import served_config as of_layout
    elif arch == "Eagle3DraftModel" or config.get("speculators_model_type") in ("eagle3", "dflash"):
        from export.speculators import _dflash_config, _eagle3_config

        return (_dflash_config if config.get("speculators_model_type") == "dflash" else _eagle3_config)(config, folder)
    elif arch == "LlamaForCausalLMEagle3":
        from export.sglang import served_config as of_layout
    elif arch in ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM"):
        from export.eagle1 import served_config as of_layout
    elif arch == "DFlashDraftModel":
        from export.dflash import served_config as of_layout
    elif arch == "MedusaModel":
        from export.medusa import served_config as of_layout
    else:
        raise ValueError(f"{folder}/config.json: architecture {arch!r} has no reader ({', '.join(READERS)})")
    return of_layout(config, folder)
