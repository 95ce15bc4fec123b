"""Which layouts carry which drafter, and one writer that dispatches on the layout: used by
the training run (its final export) and by `python -m export`."""
from __future__ import annotations

# method → the layouts that carry it, its own (the training run's default export) first
FORMATS = {"eagle3": ("speculators", "sglang"), "eagle1": ("eagle",), "medusa": ("medusa",), "mtp": ("mtp",),
           "dflash": ("dflash", "speculators")}

# why a layout cannot carry a method, where there is more to say than "it has no slot for it"
WHY_NOT = {("mtp", "speculators"): "speculators' MTP format holds one Qwen3-family layer (with q/k norms) reused for "
                                   "every step; draftsmith's MTP has one Llama-style layer per step, like the target's"}


def write_export(drafter, fmt: str, out, *, method: str, target_name: str, hf_config, target_model, joint: bool,
                 k: int, provenance: dict, dtype=None):
    """Write `drafter` (of `method`) in layout `fmt`. target_model: the target (its embedding
    and head for MTP; in joint runs the trained target, which travels with the export)."""
    if fmt not in FORMATS[method]:
        why = f"; {WHY_NOT[method, fmt]}" if (method, fmt) in WHY_NOT else ""
        raise ValueError(f"--format {fmt} cannot carry a {method} drafter (formats for {method}: {', '.join(FORMATS[method])}){why}")
    import torch

    common = dict(target_name=target_name, dtype=dtype or torch.bfloat16, provenance=provenance)
    if fmt == "speculators":
        from export.speculators import export_speculators

        return export_speculators(drafter, out, target_arch=list(hf_config.architectures or []), k=k, **common)
    if fmt == "sglang":
        from export.sglang import export_sglang

        return export_sglang(drafter, out, **common)
    if fmt == "eagle":
        from export.eagle1 import export_eagle1

        return export_eagle1(drafter, out, **common)
    if fmt == "medusa":
        from export.medusa import export_medusa

        return export_medusa(drafter, out, target_model=target_model if joint else None, **common)
    if fmt == "dflash":
        from export.dflash import export_dflash

        return export_dflash(drafter, out, **common)
    from export.mtp import export_mtp

    return export_mtp(drafter, out, target_config=hf_config.to_dict(), embed=target_model.get_input_embeddings().weight,
                      head=target_model.get_output_embeddings().weight, target_model=target_model if joint else None, **common)
