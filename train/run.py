"""The training job: config → data + target → drafter → Lightning fit → predicted.json + export."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from models.acceptance import Prediction
from train.config import ConfigError, RunConfig, max_time_seconds, to_yaml

log = logging.getLogger("draftsmith")


def _dtype(cfg: RunConfig, accelerator_is_gpu: bool) -> torch.dtype:
    if cfg.target_dtype == "auto":
        return torch.bfloat16 if accelerator_is_gpu else torch.float32
    return getattr(torch, cfg.target_dtype)


def resolve_precision(precision, accelerator):
    """`precision: auto` (the recipes' setting): bf16-mixed where training runs on CUDA, full
    float32 elsewhere, so one recipe runs on a GPU as tuned and on a laptop as written."""
    if precision != "auto":
        return precision
    on_cuda = str(accelerator) in ("auto", "gpu", "cuda") and torch.cuda.is_available()
    return "bf16-mixed" if on_cuda else "32-true"


def build_trainer(cfg: RunConfig, out_dir: Path):
    import lightning as L
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.loggers import TensorBoardLogger

    from train.callbacks import FiniteLoss, ProgressBar, Throughput, progress_refresh_rate, resumable_csv_logger
    from train.checkpoint_io import make_checkpoint_io

    loggers = [resumable_csv_logger(out_dir), TensorBoardLogger(out_dir, name="tb", version="")]
    try:
        import wandb  # noqa: F401
        from lightning.pytorch.loggers import WandbLogger

        offline = not os.environ.get("WANDB_API_KEY")
        loggers.append(WandbLogger(save_dir=str(out_dir), project="draftsmith", offline=offline))
    except ImportError:
        pass
    checkpoints = ModelCheckpoint(dirpath=out_dir / "checkpoints", every_n_train_steps=cfg.checkpoint_every_n_steps,
                                  save_last=True, save_top_k=-1, filename="step{step}", auto_insert_metric_name=False)
    accumulate = int(cfg.trainer.get("accumulate_grad_batches", 1))
    total_batches = int(cfg.trainer.get("max_steps", 1)) * accumulate
    callbacks = [checkpoints, FiniteLoss(), Throughput()]
    bar = cfg.trainer.get("enable_progress_bar")
    if bar is None or bar:  # (Lightning's own test: None is its default, on)
        callbacks.append(ProgressBar(refresh_rate=progress_refresh_rate()))
    if cfg.trainer.get("logger", True) is not False:
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    kwargs = dict(
        default_root_dir=str(out_dir),
        logger=loggers,
        callbacks=callbacks,
        plugins=[make_checkpoint_io()],
        # validation every N optimizer steps, counted in batches; at least once, at the end
        val_check_interval=min(cfg.eval.every_n_steps * accumulate, max(total_batches, 1)),
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # ChatDataModule shards by rank itself (resumable order)
        # each logged row reads every logged value back from the device (a host sync on a GPU)
        log_every_n_steps=50 if torch.cuda.is_available() else 10,
        enable_model_summary=False,
        gradient_clip_val=1.0,
    )
    kwargs.update(cfg.trainer)
    if kwargs.get("strategy") == "fsdp":  # the drafter alone, sharded (train/fsdp.py)
        from train.fsdp import fsdp_strategy

        kwargs["strategy"] = fsdp_strategy()
    kwargs["precision"] = resolve_precision(kwargs.get("precision"), kwargs.get("accelerator", "auto"))
    check_devices(kwargs.get("devices"), kwargs.get("accelerator", "auto"))
    try:
        return L.Trainer(**kwargs)
    except (TypeError, ValueError, MisconfigurationException) as e:
        raise ConfigError(f"trainer: {str(e).splitlines()[0]}") from None


def check_devices(devices, accelerator) -> None:
    """trainer.devices no larger than the machine: more CPU processes than cores (or GPUs than
    there are) spawn ranks that die, or wait for each other for good."""
    count = int(devices) if isinstance(devices, int) or (isinstance(devices, str) and devices.isdigit()) else None
    if count is None or count <= 1:
        return
    on_gpu = str(accelerator) in ("gpu", "cuda") or (str(accelerator) == "auto" and torch.cuda.is_available())
    have = torch.cuda.device_count() if on_gpu else (os.cpu_count() or 1)
    if count > have:
        raise ConfigError(f"trainer.devices: {count} is more than this machine has ({have} "
                          f"{'GPUs' if on_gpu else 'CPU cores'}); use at most {have}")


def prepare_data(cfg: RunConfig, tokenizer, vocab_size: int):
    """Tokenized train set, {name: held-out set} for eval.datasets, and the draft vocabulary
    (all cached)."""
    from data.chat import build_datasets, dataset_key
    from models.draft_vocab import build_draft_vocab, count_tokens, coverage
    from models.zoo import cache_dir

    train, heldout = build_datasets(cfg.data.dataset, tokenizer, cfg.data.max_length, cfg.data.limit,
                                    cfg.data.heldout_fraction, cfg.data.num_proc, cfg.data.plain_text)
    key = dataset_key(cfg.data.dataset, tokenizer, cfg.data.max_length, cfg.data.limit, cfg.data.heldout_fraction,
                      cfg.data.plain_text)
    counts_path = cache_dir() / "datasets" / key / "token_counts.pt"
    if counts_path.exists():
        from data.sources import DataError

        try:
            counts = torch.load(counts_path, weights_only=True)
        except Exception as e:  # (weights_only: a planted pickle is refused here, never run)
            raise DataError(f"{counts_path}: not the token counts draftsmith caches ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:120] if str(e) else ''}); refusing to load it: delete it to "
                            "have it rebuilt") from None
        if not isinstance(counts, torch.Tensor) or counts.dim() != 1 or counts.numel() != vocab_size:
            raise DataError(f"{counts_path}: not the token counts draftsmith caches (a [{vocab_size}] tensor); delete it "
                            "to have it rebuilt")
    else:
        counts = torch.as_tensor(count_tokens(train["input_ids"], train["loss_mask"], vocab_size))
        tmp = counts_path.with_name(f".{counts_path.name}.{os.getpid()}")
        torch.save(counts, tmp)
        os.replace(tmp, counts_path)  # ranks may race here; each writes the same counts
    vd = min(cfg.drafter.draft_vocab_size, vocab_size)
    d2t, t2d = build_draft_vocab(counts, vd)
    log.info("data: %d training / %d held-out conversations, %d assistant tokens; draft vocab %d covers %.1f%% of them",
             len(train), len(heldout), int(counts.sum()), vd, 100 * coverage(counts, t2d))
    heldouts = {}
    trained_prompts = None  # the training split's prompts, read once another set needs them
    for name in eval_datasets(cfg):
        if name == cfg.data.dataset:
            heldouts[name] = heldout
        else:
            if trained_prompts is None:
                batches = train.select_columns(["input_ids", "loss_mask"]).iter(1024)
                trained_prompts = {hash(prompt_tokens(ids, mask)) for batch in batches
                                   for ids, mask in zip(batch["input_ids"], batch["loss_mask"])}
            heldouts[name] = not_trained_on(build_datasets(name, tokenizer, cfg.data.max_length, None,
                                                           cfg.data.heldout_fraction, cfg.data.num_proc,
                                                           cfg.data.plain_text, heldout_only=True), trained_prompts)
        if len(heldouts[name]) == 0:  # validation (and the promise) needs at least one
            raise ConfigError(f"data.heldout_fraction: no held-out conversations in {name} at {cfg.data.heldout_fraction} "
                              "(held out by prompt hash; another set: those whose prompt training did not see); "
                              "raise data.heldout_fraction or use more data")
    return train, heldouts, d2t, t2d


def prompt_tokens(ids, mask) -> tuple:
    """A tokenized conversation's prompt: its tokens before the first answer token."""
    first = mask.index(1) if 1 in mask else len(mask)
    return tuple(ids[:first])


def not_trained_on(splits, trained_prompts: set[int]):
    """A set other than the training data (eval.datasets), scored on every conversation whose
    prompt training did not see: its own held-out split, then the rest of it minus the training
    prompts. A set of the same source (ShareGPT beside its regenerated answers) keeps its
    held-out split; a set of other questions (HumanEval's answered half) is held out whole."""
    import datasets

    rest, heldout = splits
    rows = (pair for batch in rest.select_columns(["input_ids", "loss_mask"]).iter(1024)
            for pair in zip(batch["input_ids"], batch["loss_mask"]))
    unseen = [i for i, (ids, mask) in enumerate(rows) if hash(prompt_tokens(ids, mask)) not in trained_prompts]
    return datasets.concatenate_datasets([heldout, rest.select(unseen)]) if unseen else heldout


def sampled_heldouts(cfg: RunConfig, tokenizer, greedy_heldout) -> list:
    """Held-out splits of eval.sampled_answers (by temperature, ascending; the module's order),
    each cut to the conversations the greedy promise walks (the first eval.num_sequences of
    `greedy_heldout`, matched by prompt: the tokens before the first answer), in that order."""
    from data.chat import build_datasets

    first = greedy_heldout.select(range(min(cfg.eval.num_sequences, len(greedy_heldout))))
    walked = [prompt_tokens(r["input_ids"], r["loss_mask"]) for r in first]
    sets = []
    for t in sorted(cfg.eval.sampled_answers):
        spec = cfg.eval.sampled_answers[t]
        heldout = build_datasets(spec, tokenizer, cfg.data.max_length, None, cfg.data.heldout_fraction,
                                 cfg.data.num_proc, cfg.data.plain_text, heldout_only=True)[1]
        where = {prompt_tokens(r["input_ids"], r["loss_mask"]): i for i, r in enumerate(heldout)}
        rows = [where[p] for p in walked if p in where]
        if not rows:
            raise ConfigError(f"eval.sampled_answers: {spec} (T = {t:g}) holds none of the held-out conversations of "
                              f"{cfg.data.dataset}: regenerate them at that temperature (inference.regenerate "
                              f"--dataset {cfg.data.dataset} --temperature {t:g} --heldout-only {cfg.data.heldout_fraction})")
        if len(rows) < len(walked):
            log.warning("eval.sampled_answers: %s holds %d of the %d held-out conversations the greedy promise walks; "
                        "the promise at T = %g walks those %d", spec, len(rows), len(walked), t, len(rows))
        sets.append(heldout.select(rows))
    return sets


def eval_datasets(cfg: RunConfig) -> list[str]:
    return list(cfg.eval.datasets or [cfg.data.dataset])


def is_launched_rank() -> bool:
    """A process Lightning (or torchrun) started for rank > 0: rank 0 owns the run folder."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0) != 0


def run(cfg: RunConfig, resume: str | None = None, prepare_only: bool = False, overwrite: bool = False) -> dict:
    """Train, predict acceptance, export. `out_dir` is checked first (run_folder.py) and
    written only once training is about to start: a launch that fails before leaves it as it was.
    A `trainer.fast_dev_run` rehearsal goes end to end into a temporary folder and keeps
    nothing, so it never touches (or is refused by) a real run folder."""
    if cfg.trainer.get("fast_dev_run") and not prepare_only:
        import dataclasses
        import tempfile

        # one batch end to end: one held-out batch and a few chains in each (a rehearsal's promise
        # means nothing; walking whole 2,048-token answers on a CPU took most of 17 minutes)
        rehearsal_eval = dataclasses.replace(cfg.eval, num_sequences=min(cfg.eval.num_sequences, cfg.data.batch_size),
                                             anchors_per_sequence=min(cfg.eval.anchors_per_sequence or 8, 8))
        with tempfile.TemporaryDirectory(prefix="draftsmith-rehearsal-") as tmp:
            summary = _run(dataclasses.replace(cfg, out_dir=tmp, eval=rehearsal_eval), resume, False, False)
        print(f"rehearsal (trainer.fast_dev_run) passed; nothing was kept, {cfg.out_dir} is untouched")
        return summary
    from export.io import release_output_locks

    try:
        return _run(cfg, resume, prepare_only, overwrite)
    finally:
        release_output_locks()  # out_dir's, taken by check_run_folder


def _run(cfg: RunConfig, resume: str | None, prepare_only: bool, overwrite: bool) -> dict:
    import lightning as L
    from transformers import AutoConfig, AutoTokenizer

    from data.module import ChatDataModule
    from data.templates import apply_template_choice
    from export.io import atomic_write_json, atomic_write_text
    from export.formats import auto_layout, write_export
    from models.target import Target
    from models.zoo import resolve_target
    from train.callbacks import Throughput
    from models.checkpoint import describe
    from train.checkpoint_io import load_checkpoint, remove_stale_temp_files
    from train.module import DrafterModule
    from train.run_folder import TrainingInterrupted, check_run_folder, clear_run_outputs, mark_run_folder

    out_dir = Path(cfg.out_dir)
    if not prepare_only and not is_launched_rank():
        check_run_folder(out_dir, cfg.to_dict(), resume, overwrite)
    if resume is not None:
        load_checkpoint(resume)  # weights_only: a hostile or truncated file stops here, before any load
    trainer = build_trainer(cfg, out_dir)  # Trainer errors (bad arguments) come before any load
    # seeded after the Trainer, so that nothing a strategy draws while it is built can change
    # the drafter's random initialisation
    L.seed_everything(cfg.seed, workers=True)

    target_path = resolve_target(cfg.target)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    apply_template_choice(tokenizer, cfg.data.chat_template, cfg.data.plain_text, cfg.target)  # before any data work
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    on_gpu = trainer.accelerator.__class__.__name__.startswith("CUDA")
    dtype = _dtype(cfg, on_gpu)
    hf_config = AutoConfig.from_pretrained(target_path)
    train, heldouts, d2t, t2d = prepare_data(cfg, tokenizer, hf_config.vocab_size)
    if prepare_only:
        sizes = ", ".join(f"{len(h)} held-out in {name}" for name, h in heldouts.items())
        print(f"prepared: target {target_path}, {len(train)} training conversations; {sizes}")
        return {}

    drafter = build_drafter(cfg, hf_config, d2t.numel(), mask_token_id=_mask_token(cfg, tokenizer))
    store = None
    if cfg.data.features is not None:  # training steps read the target's outputs from a store (data/features.py)
        from data.features import StoreError, open_for_run

        try:
            store = open_for_run(cfg, target_path, train, d2t, drafter, pad_id)
        except StoreError as e:
            raise ConfigError(str(e)) from None
    # (from a store, the target initialises the drafter, walks the held-out promise and is exported beside it)
    target = Target.load(cfg.target, drafter.aux_layer_ids, dtype=dtype)
    drafter.init_from_target(target.model, d2t, t2d)

    fast = bool(cfg.trainer.get("fast_dev_run"))
    max_steps = cfg.trainer.get("max_steps", 1) if not fast else int(cfg.trainer["fast_dev_run"])
    time_budget = max_time_seconds(cfg.trainer.get("max_time")) if cfg.optim.schedule_by == "time" and not fast else None
    module = DrafterModule(target, drafter, cfg.objective, cfg.optim, cfg.eval, cfg.optim.schedule_steps or max_steps,
                           eval_names=list(heldouts), time_budget_s=time_budget,
                           description=describe(cfg.drafter.method, cfg.target, target_path, hf_config, cfg.to_dict()),
                           stored_features_dtype=dtype if store is not None else None)
    sampled = sampled_heldouts(cfg, tokenizer, next(iter(heldouts.values())))  # eval.sampled_answers' walks
    datamodule = ChatDataModule(train if store is None else store, list(heldouts.values()) + sampled, pad_id, cfg.data.batch_size, cfg.seed,
                                cfg.data.num_workers,
                                max_steps=max_steps, accumulate=trainer.accumulate_grad_batches,
                                eval_sequences=cfg.eval.num_sequences, eval_max_length=cfg.eval.max_length)
    datamodule.check_batches(trainer.world_size)
    perplexity, before = {}, {}
    if cfg.objective.joint:  # the price of joint training, on every held-out set's answers (the
        from train.joint import heldout_perplexity  # first at the top, the others under "also")

        # measured on the device it trains on: Lightning moves the target there only in fit, and
        # on the CPU it would take minutes before a GPU run could start
        target.to(trainer.strategy.root_device)
        before = {name: heldout_perplexity(target, datamodule._heldout_loader(h)) for name, h in heldouts.items()}
    if trainer.is_global_zero:  # training starts now: the first write into the run folder
        if overwrite and resume is None:
            clear_run_outputs(out_dir)
        mark_run_folder(out_dir)  # first: what makes the folder a run (train/run_folder.py)
        remove_stale_temp_files(out_dir / "checkpoints")
        atomic_write_text(out_dir / "config.yaml", to_yaml(cfg))
    t0 = time.time()
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=resume, weights_only=True)
    except SystemExit:  # Lightning exits after a graceful shutdown on Ctrl-C / SIGTERM
        if trainer.interrupted:
            raise TrainingInterrupted(trainer.global_step, out_dir / "checkpoints" / "last.ckpt") from None
        raise
    fit_seconds = time.time() - t0
    if trainer.interrupted:
        raise TrainingInterrupted(trainer.global_step, out_dir / "checkpoints" / "last.ckpt")
    if trainer.global_step > 0 and not fast:
        # the final state, whatever checkpoint_every_n_steps says, so a later --resume (a longer
        # max_steps, or the second half of a split schedule) continues from exactly here
        # the whole state (optimizer and loops too: weights_only=False is what is saved; loading
        # still reads it as plain data only)
        trainer.save_checkpoint(out_dir / "checkpoints" / "last.ckpt", weights_only=False)

    # Final predicted acceptance on held-out data, drafting exactly as the runtime drafts.
    if module.predicted is None or module.predicted.step != trainer.global_step:
        trainer.validate(module, datamodule=datamodule, verbose=False)
    predicted = module.predicted
    if cfg.objective.joint:
        for i, (name, h) in enumerate(heldouts.items()):
            after = heldout_perplexity(target, datamodule._heldout_loader(h))
            stats = {"dataset": name, "before": before[name], "after": after, "relative_change": after / before[name] - 1}
            if i == 0:
                perplexity.update(stats)
            else:
                perplexity.setdefault("also", {})[name] = stats
    summary = {
        "predicted": predicted.to_dict() if predicted else {},
        "dataset": cfg.data.dataset,
        "heldout_conversations": {name: min(cfg.eval.num_sequences, len(h)) for name, h in heldouts.items()},
        "train_steps": int(trainer.global_step),
        "fit_seconds": round(fit_seconds, 1),
        "walk_seconds": {part: round(t, 1) for part, t in module.walk_seconds.items()},  # the final held-out walk
        "throughput": next(c for c in trainer.callbacks if isinstance(c, Throughput)).summary(),
    }
    if perplexity:
        summary["target_perplexity"] = perplexity
    from train.fsdp import gathered_drafter

    export_drafter = gathered_drafter(module.drafter)  # full parameters under FSDP (every rank gathers)
    if trainer.is_global_zero:
        atomic_write_json(out_dir / "predicted.json", summary)
        export_dir = out_dir / "export"
        last_ckpt = out_dir / "checkpoints" / "last.ckpt"
        provenance = {"target": cfg.target, "target_weights_sha256": module.description["target"]["weights_sha256"],
                      "training_config": cfg.to_dict(), "predicted_acceptance": summary["predicted"],
                      "target_perplexity": perplexity or None,
                      "checkpoint": str(last_ckpt.resolve()) if last_ckpt.is_file() else None}
        fmt = auto_layout(cfg.drafter.method, export_drafter) if cfg.export_format == "auto" else cfg.export_format
        write_export(export_drafter, fmt, export_dir, method=cfg.drafter.method, target_name=cfg.target,
                     hf_config=hf_config, target_model=target.model, joint=cfg.objective.joint, k=cfg.eval.k,
                     provenance=provenance, runtime_only=True)
        if predicted:
            _print_prediction(predicted)
            walk = summary["walk_seconds"]
            print(f"final held-out walk: {sum(walk.values()):.1f} s (" + ", ".join(f"{part} {t:.1f} s" for part, t in walk.items())
                  + ")")
        for stats in ([perplexity] + list(perplexity.get("also", {}).values())) if perplexity else []:
            print(f"target perplexity on held-out {stats['dataset']}: {stats['before']:.3f} before, "
                  f"{stats['after']:.3f} after ({stats['relative_change']:+.2%})")
        print(f"wrote {out_dir / 'predicted.json'} and {export_dir}")
    return summary


def _print_prediction(predicted: Prediction):
    """The promise on the console: per held-out set, greedy chains (and by turn), sampled, trees."""
    from inference.walks.tree import tree_words

    for name, held in [(predicted.dataset, predicted.heldout)] + list(predicted.also.items()):
        stats, turns = held.greedy, held.greedy.per_turn or {}
        print(f"predicted acceptance on held-out {name} (k={predicted.k}, T=0): "
              f"tau = {stats.tau:.3f}, a_i = {[round(a, 3) for a in stats.a]}"
              + "".join(f"; {label} {t.tau:.3f} ({t.num_chains} chains)" for label, t in
                        (("first answers", turns.get("1")), ("follow-up turns", turns.get("2+"))) if t and t.num_chains))
        for promise in held.sampled:
            print(f"  at T={promise.temperature:g}, {promise.verification} verification: tau = "
                  f"{promise.acceptance.tau:.3f} ± {promise.acceptance.tau_se:.3f}")
        for tree in held.trees:
            print(f"  tree {tree_words(tree.shape)} "
                  f"({tree.verify_tokens_per_step} verify tokens per step), T=0: tau = {tree.acceptance.tau:.3f}")


def _mask_token(cfg: RunConfig, tokenizer) -> int:
    """The default mask token a method may use (DFlash, unless its section names one)."""
    return default_mask_token(tokenizer)


def default_mask_token(tokenizer) -> int:
    """DFlash's mask: a special token of the target that chat text never uses (not bos / eos /
    pad / unk, absent from a rendered conversation), so a MASK never reads as end-of-turn;
    the unknown (else pad, else eos) token when there is none."""
    taken = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    try:
        sample = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        taken |= set(tokenizer.apply_chat_template(sample, tokenize=True))
    except Exception:  # no chat template: only the named special tokens are excluded
        pass
    special = sorted(i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False))
    for i in special:
        if i not in taken:
            return i
    for i in (tokenizer.unk_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id):
        if i is not None:
            return i
    return 0


def build_drafter(cfg: RunConfig, hf_config, draft_vocab_size: int, mask_token_id: int = 0):
    """The drafter of `drafter.method`, shaped for this target (weights initialised later), as
    its row of models/methods.py builds it."""
    from models.methods import method

    try:
        return method(cfg.drafter.method).build(cfg.drafter, hf_config, draft_vocab_size, mask_token_id)
    except ValueError as e:  # a shape the target cannot give (e.g. DFlash's layers): a config error
        raise ConfigError(f"drafter: {e}") from None
