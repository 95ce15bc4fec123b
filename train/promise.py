"""python -m train.promise EXPORT [eval.KEY=VALUE ...] [data.dataset=PATH]: make an export's
promise again, for other serving settings, without training again.

    python -m train.promise runs/eagle3/export eval.max_new_tokens=512 eval.temperatures=[0,0.7]

The promise (predicted acceptance in draftsmith.json) is training's held-out walk: the same
held-out conversations (the export's own training config: data set, held-out fraction,
eval.num_sequences), the same function (DrafterModule's validation, through a Lightning
Trainer), drafting as the runtime drafts. Only `eval.*` settings change (the serving budget
per answer, temperatures, trees, chain length, how many held-out conversations), and
`data.dataset` where the training data now lives elsewhere (same conversations: the held-out
split is by prompt hash). Each promise is the training config with this call's settings
over it (nothing carries over from an earlier promise). The new promise replaces the old one
in draftsmith.json, `promise_config` records the settings it was made with (validate reads
the answer budget there; `training_config` still says how the drafter was trained), and
`promise_history` keeps what the old one said. The write is atomic; the weights are not
touched. Joint exports (Medusa-2, joint MTP) trained their target too: refused.
"""
from __future__ import annotations

import datetime
import sys
from pathlib import Path

CHANGEABLE = ("eval.", "data.dataset")


def repromise(export_dir: str, overrides: list[str], progress: bool = True) -> dict:
    """Walk the export's held-out set again with `overrides` and store the promise → its dict."""
    import lightning as L
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from data.module import ChatDataModule
    from data.templates import apply_template_choice
    from export.io import atomic_write_json, read_json
    from export.load import load_export
    from models.target import Target
    from models.zoo import resolve_target
    from train.config import ConfigError, config_from_dict, parse_override
    from train.module import DrafterModule
    from train.run import _dtype, prepare_data, resolve_precision, sampled_heldouts

    folder = Path(export_dir)
    prov_path = folder / "draftsmith.json"
    if not prov_path.is_file():
        raise ConfigError(f"{folder}: no draftsmith.json (an export made by `python -m train` keeps its training config there)")
    provenance = read_json(prov_path)
    tree = provenance.get("training_config") if isinstance(provenance, dict) else None
    if not isinstance(tree, dict):
        raise ConfigError(f"{prov_path}: no training_config to make the promise with")
    for text in overrides:
        key = parse_override(text)[0]
        if not key.startswith(CHANGEABLE):
            raise ConfigError(f"{key}: only eval.* settings (and data.dataset) change a promise; the rest is the trained drafter's")
    cfg = config_from_dict(tree, overrides)
    if cfg.objective.joint:
        raise ConfigError(f"{folder}: a joint export ({cfg.drafter.method}, objective.joint) serves the target it trained; "
                          "its promise is made with that target at training time only")

    on_gpu = torch.cuda.is_available()
    target_path = resolve_target(cfg.target)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    apply_template_choice(tokenizer, cfg.data.chat_template, cfg.data.plain_text, cfg.target)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    hf_config = AutoConfig.from_pretrained(target_path)
    train, heldouts, _, _ = prepare_data(cfg, tokenizer, hf_config.vocab_size)
    drafter = load_export(folder)  # float32 master weights, as training keeps them
    target = Target.load(cfg.target, drafter.aux_layer_ids, dtype=_dtype(cfg, on_gpu))
    module = DrafterModule(target, drafter, cfg.objective, cfg.optim, cfg.eval, 1, eval_names=list(heldouts))
    sampled = sampled_heldouts(cfg, tokenizer, next(iter(heldouts.values())))
    datamodule = ChatDataModule(train, list(heldouts.values()) + sampled, pad_id, cfg.data.batch_size, cfg.seed, 0,
                                max_steps=1, eval_sequences=cfg.eval.num_sequences, eval_max_length=cfg.eval.max_length)
    accelerator = "gpu" if on_gpu else "cpu"
    trainer = L.Trainer(accelerator=accelerator, devices=1, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, enable_progress_bar=progress,
                        precision=resolve_precision(cfg.trainer.get("precision"), accelerator))
    trainer.validate(module, datamodule=datamodule, verbose=False)
    predicted = module.predicted.to_dict()

    old = provenance.get("predicted_acceptance") or {}
    history = list(provenance.get("promise_history") or [])
    history.append({"replaced": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "settings": provenance.get("promise_config") or {"eval": tree.get("eval")},
                    "tau": old.get("tau"), "k": old.get("k"),
                    "per_turn": {t: v.get("tau") for t, v in (old.get("per_turn") or {}).items()},
                    "sampled": [{key: s.get(key) for key in ("temperature", "verification", "tau")}
                                for s in old.get("sampled") or []]})
    provenance["predicted_acceptance"] = predicted
    provenance["promise_config"] = {"eval": cfg.to_dict()["eval"], "data.dataset": cfg.data.dataset,
                                    "overrides": list(overrides)}
    provenance["promise_history"] = history
    atomic_write_json(prov_path, provenance)
    return predicted


def main(argv=None) -> int:
    from inference.cli import Parser  # usage errors as one `error:` line, exit code 2, as every command

    ap = Parser(prog="python -m train.promise", description=__doc__.split("\n\n")[0])
    ap.add_argument("export", help="an export folder written by `python -m train`")
    ap.add_argument("overrides", nargs="*", help="eval.KEY=VALUE (or data.dataset=PATH) settings to promise for")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    from data.sources import DataError
    from models.acceptance import Prediction
    from models.zoo import AssetError
    from train.config import ConfigError
    from train.run import _print_prediction

    try:
        predicted = repromise(args.export, args.overrides, progress=not args.no_progress)
    except (ConfigError, DataError, AssetError, OSError, ValueError, KeyError, RuntimeError) as e:
        print(f"error: {str(e).strip(chr(39))}", file=sys.stderr)
        return 2
    _print_prediction(Prediction.from_dict(predicted))
    print(f"wrote the promise into {Path(args.export) / 'draftsmith.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
