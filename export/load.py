"""Read any export draftsmith writes back into its module: the layout modules of the method
table (export/formats.py) are asked in turn whether config.json is theirs."""
from __future__ import annotations

import json
from pathlib import Path

import torch

READERS = {"Eagle3DraftModel": "speculators", "LlamaForCausalLMEagle3": "sglang", "LlamaForCausalLMEagle": "eagle",
           "EagleLlamaForCausalLM": "eagle-vllm",
           "MedusaModel": "medusa", "DFlashDraftModel": "dflash (z-lab) or speculators (with speculators_model_type)"}


def _layout_of(config: dict, where):
    from export.formats import layout_modules

    for layout in layout_modules():
        if layout.reads(config):
            return layout
    arch = (config.get("architectures") or [None])[0]
    raise ValueError(f"{where}: architecture {arch!r} has no reader ({', '.join(READERS)})")


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
    return _layout_of(config, config_path).read(folder, dtype=dtype, served=served)


def served_config(folder: str | Path):
    """The drafter config a server builds from the folder's config.json alone (with its
    defaults for absent keys), whether or not the tensors then load: export.check compares it
    field by field with the trained drafter's."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    return _layout_of(config, f"{folder}/config.json").served_config(config, folder)
