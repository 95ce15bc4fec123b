"""The bad-input corpus: one row per probe of bad input, hostile input or a path that must not
be clobbered. tests/test_bad_inputs.py runs every row through the command's own main(argv)
and checks the exit code, that the one `error:` line holds the phrase, that no traceback is
printed, that the `unchanged` paths are byte for byte what they were and that the `absent`
paths were not created. Add a row for every bug found.

Placeholders in braces are paths built once by the test's fixture (see WORLD there):
  {run}       a finished tiny training run (config, checkpoints, logs, predicted.json, export)
  {export}    a copy of its export elsewhere          {userfile}  a file of the user's
  {userdir}   a folder of the user's (not a run, not an export)
  {fresh}     a path that does not exist and must still not exist afterwards
  {chat}      a good chat JSONL                       {nonutf8}   a chat file with a non-UTF-8 byte
  {twochats}  a chat file of two conversations (none held out)
  {norole}    chat rows whose messages lack a role    {evilckpt}  a pickle that runs code when unpickled
  {evilrun}   a run folder whose last.ckpt is that pickle
  {truncckpt} a truncated checkpoint                  {truncrun}  a run folder holding it
  {truncst}   a target folder with a truncated model.safetensors
  {truncgguf} a truncated GGUF file                   {notemplate} a target whose tokenizer has no chat template
  {longprompt} a prompt beyond the tiny target's 4,096-token window
  {marker}    the file the hostile pickle would create
  {badmeta}   an export whose draftsmith.json is not JSON     {badconfig} an export whose config.json is not JSON
  (issue 52's inputs)
  {nanexport} an export with a NaN weight (its weights_sha256 updated)   {intexport} one with an int32 norm weight
  {editedexport} an export whose weights differ from its recorded weights_sha256
  {zeroexport} an export with a 0-byte model.safetensors   {cutexport} one with a truncated model.safetensors
  {listprompt} a prompts file whose prompt is a list    {nullcategory} one whose category is null
  {noprompt}  a prompts file whose row has no prompt field      {mdfolder} a folder of .md files
  {project}   a Hydra-style folder (config.yaml, logs/, export/) of another tool
  {results}   a folder holding another tool's report.json and other files
  {exportckpt} an export folder the user put a checkpoint ({ownckpt}) and notes into
  {othertarget} the tiny target's architecture with other weights
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    cli: str  # train, export, export.check, generate, validate, bench, regenerate
    argv: tuple
    code: int
    phrase: str
    unchanged: tuple = ("{run}", "{export}", "{userfile}", "{userdir}")
    absent: tuple = ("{fresh}", "{marker}")
    tiny_train: bool = False  # prepend the tiny training overrides (out_dir={fresh})


def train(*argv, code=2, phrase="", tiny=True, **kw):
    return Case("train", argv, code, phrase, tiny_train=tiny, **kw)


def cli(name):
    def make(*argv, code=2, phrase="", **kw):
        return Case(name, argv, code, phrase, **kw)
    return make


export, check, generate, validate, bench, regenerate, promise = (
    cli(n) for n in ("export", "export.check", "generate", "validate", "bench", "regenerate", "promise"))
extract = cli("extract")
G = ("--target", "tiny-random-llama", "--device", "cpu")  # generate: the tiny target, on the CPU
V = ("--drafter", "{export}", "--dataset", "mt-bench", "--device", "cpu", "--out", "{fresh}")
B = ("--target", "tiny-random-llama", "--device", "cpu", "--out", "{fresh}")
R = ("--target", "tiny-random-llama", "--dataset", "{chat}", "--device", "cpu", "--out", "{fresh}")

CASES = {
    # ---- train: config values out of range or of the wrong type (one table, before anything loads)
    "train-negative-lr": train("optim.lr=-0.001", phrase="optim.lr: must be a positive number"),
    "train-tree-more-nodes-than-drafted": train("eval.trees=[[2,2,40]]", phrase="eval.trees: must be a list of [depth, "
                                                "top_k, total_tokens] or [depth, top_k, total_tokens, children], "
                                                "positive integers with total_tokens at most"),
    "train-nan-lr": train("optim.lr=.nan", phrase="optim.lr: must be a positive number"),
    "train-lr-1e-3-is-a-number": train("optim.lr=1e-3", "optim.betas=[0.9]", phrase="optim.betas: must be two numbers"),
    "train-max-steps-abc": train("trainer.max_steps=abc", phrase="trainer.max_steps: must be a positive integer"),
    "train-max-steps-negative": train("trainer.max_steps=-1", phrase="trainer.max_steps: must be a positive integer"),
    "train-max-steps-zero": train("trainer.max_steps=0", phrase="trainer.max_steps: must be a positive integer"),
    "train-heldout-zero": train("data.heldout_fraction=0", phrase="data.heldout_fraction: must be a fraction in (0, 1)"),
    "train-heldout-one": train("data.heldout_fraction=1", phrase="data.heldout_fraction"),
    "train-eval-sequences-zero": train("eval.num_sequences=0", phrase="eval.num_sequences: must be a positive integer"),
    "train-negative-ttt-decay": train("objective.ttt_decay=-0.5", phrase="objective.ttt_decay: must be in (0, 1]"),
    "train-min-lr-ratio": train("optim.min_lr_ratio=2", phrase="optim.min_lr_ratio: must be a fraction in [0, 1]"),
    "train-warmup-negative": train("optim.warmup_steps=-3", phrase="optim.warmup_steps: must be a non-negative integer"),
    "train-workers-negative": train("data.num_workers=-1", phrase="data.num_workers: must be a non-negative integer"),
    "train-limit-zero": train("data.limit=0", phrase="data.limit: must be a positive integer or null"),
    "train-seed-negative": train("seed=-1", phrase="seed: must be an integer in [0, 4294967295]"),
    "train-vocab-zero": train("drafter.draft_vocab_size=0", phrase="drafter.draft_vocab_size: must be a positive integer"),
    "train-accumulate-zero": train("trainer.accumulate_grad_batches=0", phrase="trainer.accumulate_grad_batches"),
    "train-precision-unknown": train("trainer.precision=fp7", phrase="trainer.precision: must be auto"),
    "train-accelerator-unknown": train("trainer.accelerator=quantum", phrase="trainer.accelerator: must be one of"),
    "train-fast-dev-run-negative": train("trainer.fast_dev_run=-2", phrase="trainer.fast_dev_run"),
    "train-max-length-beyond-context": train("data.max_length=100000", phrase="beyond the target's context window of 4096"),
    "train-eval-length-beyond-context": train("eval.max_length=5000", phrase="eval.max_length: 5000 tokens is beyond"),
    "train-checkpoint-every-zero": train("checkpoint_every_n_steps=0", phrase="checkpoint_every_n_steps: must be a positive"),
    "train-chat-template-missing": train("data.chat_template=/no/such/template.jinja", phrase="data.chat_template"),
    "train-template-and-plain-text": train("data.chat_template=chatml", "data.plain_text=true", phrase="exclude each other"),
    # ---- train: the run folder is never clobbered
    "train-into-finished-run": train("out_dir={run}", phrase="already holds a finished run; continue it with --resume"),
    "train-into-user-folder": train("out_dir={userdir}", "--overwrite", phrase="not a draftsmith run"),
    "train-out-dir-is-a-file": train("out_dir={userfile}", phrase="is a file, not a folder"),
    "train-out-dir-under-a-file": train("out_dir={userfile}/sub", phrase="is a file, not a folder"),
    "train-resume-and-overwrite": train("--resume", "--overwrite", phrase="give one"),
    "train-resume-fails-on-data-writes-nothing": train("out_dir={run}", "data.dataset={nonutf8}", "--resume",
                                                       phrase="not UTF-8 text (byte 0xe9"),
    "train-resume-different-drafter": train("out_dir={run}", "drafter.eagle3.norm_before_fc=true", "--resume",
                                            phrase="holds a run with a different drafter.eagle3.norm_before_fc (False there, True now)"),
    "train-resume-different-target": train("out_dir={run}", "target={notemplate}", "--resume",
                                           phrase="holds a run with a different target"),
    # ---- train: hostile and corrupt inputs
    "train-resume-hostile-pickle": train("--resume", "{evilckpt}", phrase="refusing to load it"),
    "train-resume-truncated-checkpoint": train("--resume", "{truncckpt}", phrase="not a readable checkpoint"),
    "train-truncated-gguf-target": train("target={truncgguf}", phrase="is unreadable (truncated or corrupt"),
    "train-truncated-safetensors-target": train("target={truncst}", phrase="model.safetensors is truncated"),
    "train-non-utf8-data": train("data.dataset={nonutf8}", phrase="not UTF-8 text"),
    "train-messages-without-role": train("data.dataset={norole}", phrase="a message without a role"),
    "train-target-without-chat-template": train("target={notemplate}", phrase="has no chat template; set data.chat_template"),
    "train-no-heldout-conversations": train("data.dataset={twochats}", phrase="no held-out conversations"),
    "train-unknown-flag": train("--frobnicate", phrase="unrecognized arguments"),
    # ---- export: --out is never anything but a new folder or (with --force) a draftsmith export
    "export-out-user-file": export("--checkpoint", "{run}", "--format", "speculators", "--out", "{userfile}",
                                   phrase="is an existing file; refusing to replace it"),
    "export-out-user-folder": export("--checkpoint", "{run}", "--format", "speculators", "--out", "{userdir}", "--force",
                                     phrase="not a draftsmith export; refusing to replace it"),
    "export-out-run-folder": export("--checkpoint", "{run}", "--format", "speculators", "--out", "{run}", "--force",
                                    phrase="not a draftsmith export"),
    "export-out-existing-export": export("--checkpoint", "{run}", "--format", "speculators", "--out", "{export}",
                                         phrase="already holds a draftsmith export; pass --force"),
    "export-out-under-a-file": export("--checkpoint", "{run}", "--format", "speculators", "--out", "{userfile}/x",
                                      phrase="is a file, not a folder"),
    "export-hostile-pickle": export("--checkpoint", "{evilrun}", "--format", "speculators", "--out", "{fresh}",
                                    phrase="refusing to load it"),
    "export-truncated-checkpoint": export("--checkpoint", "{truncrun}", "--format", "speculators", "--out", "{fresh}",
                                          phrase="not a readable checkpoint"),
    "export-missing-checkpoint": export("--checkpoint", "{userdir}", "--format", "speculators", "--out", "{fresh}",
                                        phrase="does not exist"),
    "export-format-cannot-carry": export("--checkpoint", "{run}", "--format", "medusa", "--out", "{fresh}",
                                         phrase="cannot carry a eagle3 drafter"),
    "export-bad-dtype": export("--checkpoint", "{run}", "--format", "speculators", "--out", "{fresh}", "--dtype", "int8",
                               phrase="invalid choice"),
    # ---- export.check
    "check-not-a-folder": check("{userfile}", phrase="is not a folder"),
    "check-missing": check("{fresh}", phrase="is not a folder"),
    "check-user-folder": check("{userdir}", phrase="no draftsmith.json"),
    "check-hostile-checkpoint": check("{export}", "--checkpoint", "{evilckpt}", phrase="refusing to load it"),
    "check-truncated-checkpoint": check("{export}", "--checkpoint", "{truncckpt}", phrase="not a readable checkpoint"),
    "check-corrupt-draftsmith-json": check("{badmeta}", phrase="draftsmith.json"),
    "check-missing-checkpoint": check("{export}", "--checkpoint", "{fresh}", phrase="does not exist"),
    # ---- generate
    "generate-negative-new-tokens": generate("--prompt", "hi", *G, "--max-new-tokens", "-5", phrase="--max-new-tokens: must be positive"),
    "generate-negative-temperature": generate("--prompt", "hi", *G, "--temperature", "-1", phrase="--temperature: must be >= 0"),
    "generate-top-p-zero": generate("--prompt", "hi", *G, "--top-p", "0", phrase="--top-p: must be in (0, 1]"),
    "generate-top-k-negative": generate("--prompt", "hi", *G, "--top-k", "-1", phrase="--top-k: must be >= 0"),
    "generate-adaptive-costs-folder": generate("--prompt", "hi", *G, "--adaptive-verification", "{userdir}",
                                              phrase="cannot read the step-cost table"),
    "generate-adaptive-costs-not-json": generate("--prompt", "hi", *G, "--adaptive-verification", "{userfile}",
                                                phrase="--adaptive-verification: "),
    "generate-k-zero": generate("--prompt", "hi", *G, "-k", "0", phrase="-k: must be at least 1"),
    "generate-cuda-without-cuda": generate("--prompt", "hi", "--device", "cuda", phrase="no CUDA device on this machine"),
    "generate-unknown-device": generate("--prompt", "hi", "--device", "tpu", phrase="--device: 'tpu' is not auto, cpu"),
    "generate-drafter-vs-proposer": generate("--prompt", "hi", *G, "--drafter", "{export}", "--proposer", "ngram",
                                             phrase="would be ignored by --proposer ngram"),
    "generate-draft-model-vs-proposer": generate("--prompt", "hi", *G, "--draft-model", "tiny-random-llama", "--proposer", "suffix",
                                                 phrase="--draft-model tiny-random-llama would be ignored by --proposer suffix"),
    "generate-drafter-not-an-export": generate("--prompt", "hi", *G, "--drafter", "{userdir}", phrase="is not an export folder"),
    "generate-chat-non-utf8": generate("--chat", "{nonutf8}", *G, phrase="is not a JSON list of {role, content} messages"),
    "generate-chat-without-role": generate("--chat", "{norole}", *G, phrase="is not a JSON list of {role, content} messages"),
    "generate-truncated-safetensors": generate("--prompt", "hi", "--target", "{truncst}", "--device", "cpu",
                                               phrase="model.safetensors is truncated"),
    "generate-truncated-gguf": generate("--prompt", "hi", "--target", "{truncgguf}", "--device", "cpu",
                                        phrase="is unreadable (truncated or corrupt"),
    "generate-no-chat-template": generate("--prompt", "hi", "--target", "{notemplate}", "--device", "cpu",
                                          phrase="has no chat template"),
    "generate-prometheus-over-a-user-file": generate("--prompt", "hi", *G, "--prometheus", "{userfile}",
                                                     phrase="was not written by this command; refusing to replace it"),
    "generate-prompt-beyond-context": generate("--prompt", "{longprompt}", *G, "--max-new-tokens", "16",
                                               phrase="beyond the target's context window of 4096 tokens"),
    "generate-new-tokens-beyond-context": generate("--prompt", "hi", *G, "--max-new-tokens", "5000",
                                                   phrase="beyond the target's context window"),
    # ---- validate
    "validate-num-prompts-zero": validate(*V, "--num-prompts", "0", phrase="--num-prompts: must be positive, got 0"),
    "validate-num-prompts-negative": validate(*V, "--num-prompts", "-3", phrase="--num-prompts: must be positive"),
    "validate-negative-new-tokens": validate(*V, "--max-new-tokens", "-5", phrase="--max-new-tokens: must be positive"),
    "validate-k-negative": validate(*V, "-k", "-1", phrase="-k: must be positive"),
    "validate-max-turns-zero": validate(*V, "--max-turns", "0", phrase="--max-turns: must be positive"),
    "validate-negative-tolerance": validate(*V, "--tolerance", "-0.1", phrase="--tolerance: must be >= 0"),
    "validate-cuda-without-cuda": validate("--drafter", "{export}", "--dataset", "mt-bench", "--device", "cuda",
                                           phrase="no CUDA device on this machine"),
    "validate-out-is-a-file": validate("--drafter", "{export}", "--dataset", "mt-bench", "--device", "cpu", "--out", "{userfile}",
                                       phrase="is an existing file, not a folder"),
    "validate-out-user-folder": validate("--drafter", "{export}", "--dataset", "mt-bench", "--device", "cpu", "--out",
                                         "{userdir}", phrase="is an existing folder not a draftsmith validate output"),
    "validate-new-tokens-beyond-context": validate(*V, "--max-new-tokens", "5000", phrase="beyond the target's context window"),
    "validate-tree-not-three-numbers": validate(*V, "--tree", "2,2", phrase="--tree 2,2: expected DEPTH,TOPK,NODES"),
    "validate-tree-not-promised": validate(*V, "--tree", "2,2,4", phrase="--tree 2,2,4: the export promises no such tree "
                                           "(it promises no trees: train with eval.trees=[[2, 2, 4]])"),
    "validate-prompt-beyond-context": validate(*V, "--max-new-tokens", "4090", "--num-prompts", "1",
                                              phrase="question 81, turn 1 ("),
    "validate-drafter-not-an-export": validate("--drafter", "{userdir}", "--dataset", "mt-bench", "--device", "cpu",
                                               "--out", "{fresh}", phrase="is not an export folder"),
    "validate-corrupt-config-json": validate("--drafter", "{badconfig}", "--dataset", "mt-bench", "--device", "cpu",
                                             "--out", "{fresh}", "--target", "tiny-random-llama", phrase="config.json"),
    "generate-corrupt-drafter-config": generate("--prompt", "hi", *G, "--drafter", "{badconfig}", phrase="config.json"),
    # ---- bench
    "bench-num-prompts-zero": bench(*B, "--num-prompts", "0", phrase="--num-prompts: must be positive"),
    "bench-num-prompts-negative": bench(*B, "--num-prompts", "-2", phrase="--num-prompts: must be positive"),
    "bench-negative-new-tokens": bench(*B, "--max-new-tokens", "-5", phrase="--max-new-tokens: must be positive"),
    "bench-adaptive-without-drafter": bench(*B, "--adaptive-verification", "measure",
                                            phrase="--adaptive-verification: it times drafters with a confidence head"),
    "bench-adaptive-eagle3-drafter": bench(*B, "--num-prompts", "1", "--max-new-tokens", "2", "--hf-prompts", "1",
                                           "--drafter", "{export}", "--adaptive-verification", "measure",
                                           phrase="--adaptive-verification: no --drafter has a confidence head"),
    "bench-k-zero": bench(*B, "-k", "0", phrase="-k: must be positive"),
    "bench-cuda-without-cuda": bench("--device", "cuda", "--out", "{fresh}", phrase="no CUDA device on this machine"),
    "bench-out-is-a-file": bench("--target", "tiny-random-llama", "--device", "cpu", "--out", "{userfile}",
                                 phrase="is an existing file, not a folder"),
    "bench-out-user-folder": bench("--target", "tiny-random-llama", "--device", "cpu", "--out", "{userdir}",
                                   phrase="is a folder of other files (no bench.json"),
    "bench-drafter-not-an-export": bench(*B, "--drafter", "{userdir}", phrase="is not an export folder"),
    "bench-new-tokens-beyond-context": bench(*B, "--max-new-tokens", "5000", phrase="beyond the target's context window"),
    "bench-tree-not-three-numbers": bench(*B, "--tree", "5,8", phrase="--tree 5,8: expected DEPTH,TOPK,NODES"),
    "bench-tree-more-nodes-than-drafted": bench(*B, "--tree", "2,2,40", phrase="nodes at most the 6 candidates"),
    "bench-tree-children-zero": bench(*B, "--tree", "2,2,4,0", phrase="--tree 2,2,4,0: depth, top-k, nodes and children "
                                      "must be positive"),
    "bench-tree-narrow-more-nodes-than-drafted": bench(*B, "--tree", "3,2,9,1", phrase="nodes at most the 6 candidates"),
    "validate-tree-narrow-not-promised": validate(*V, "--tree", "2,2,3,1", phrase="--tree 2,2,3,1: the export promises "
                                                  "no such tree (it promises no trees: train with eval.trees=[[2, 2, 3, 1]])"),
    "validate-tree-five-numbers": validate(*V, "--tree", "2,2,4,1,1", phrase="--tree 2,2,4,1,1: expected "
                                           "DEPTH,TOPK,NODES[,CHILDREN]"),
    "bench-prompt-beyond-context": bench(*B, "--max-new-tokens", "4090", "--num-prompts", "1",
                                         phrase="prompt 81 of mt-bench ("),
    # ---- regenerate
    "regenerate-mistyped-dataset-writes-nothing": regenerate("--target", "tiny-random-llama", "--dataset", "sharegtp",
                                                             "--device", "cpu", "--out", "{fresh}", phrase="is not a zoo name"),
    "regenerate-max-length-beyond-context": regenerate(*R, "--max-length", "5000",
                                                       phrase="--max-length 5000 is beyond the target's context window of 4096"),
    "regenerate-batch-size-zero": regenerate(*R, "--batch-size", "0", phrase="--batch-size: must be positive"),
    "regenerate-negative-new-tokens": regenerate(*R, "--max-new-tokens", "-5", phrase="--max-new-tokens: must be positive"),
    "regenerate-max-minutes-zero": regenerate(*R, "--max-minutes", "0", phrase="--max-minutes: must be positive"),
    "regenerate-limit-zero": regenerate(*R, "--limit", "0", phrase="--limit: must be positive"),
    "regenerate-bad-shard": regenerate(*R, "--shard", "2/2", phrase="--shard must be I/N"),
    "regenerate-cuda-without-cuda": regenerate("--dataset", "{chat}", "--device", "cuda", "--out", "{fresh}",
                                               phrase="no CUDA device on this machine"),
    "regenerate-out-is-a-file": regenerate("--target", "tiny-random-llama", "--dataset", "{chat}", "--device", "cpu",
                                           "--out", "{userfile}", phrase="is an existing file, not a folder"),
    "regenerate-out-user-folder": regenerate("--target", "tiny-random-llama", "--dataset", "{chat}", "--device", "cpu",
                                             "--out", "{userdir}", phrase="is an existing folder not written by regenerate"),
    "regenerate-new-tokens-beyond-length": regenerate(*R, "--max-new-tokens", "4000", "--max-length", "2048",
                                                      phrase="leaves no room for a prompt"),
    "regenerate-non-utf8-dataset": regenerate("--target", "tiny-random-llama", "--dataset", "{nonutf8}", "--device", "cpu",
                                              "--out", "{fresh}", phrase="not UTF-8 text"),
    # (inference.regenerate answers a benchmark's questions: that is a data set it makes)
    "train-on-a-benchmark": train("data.dataset=mt-bench", phrase="benchmark of prompts without answers"),
}

# issue 52: folders that are not this project's output, damaged exports, malformed data, and
# what gave a traceback instead of one line
ISSUE_52 = {
    # ---- data loss: a folder is ours only by our marker, never by a file name
    "export-force-into-folder-holding-its-checkpoint": export("--checkpoint", "{ownckpt}", "--format", "speculators",
                                                              "--out", "{exportckpt}", "--force",
                                                              phrase="this command's input; refusing to replace it",
                                                              unchanged=("{exportckpt}", "{run}", "{export}")),
    "export-force-into-export-the-user-added-to": export("--checkpoint", "{run}", "--format", "speculators", "--out",
                                                         "{exportckpt}", "--force",
                                                         phrase="also holds mine.ckpt that export did not write",
                                                         unchanged=("{exportckpt}", "{run}")),
    "validate-out-holds-another-report-json": validate("--drafter", "{export}", "--dataset", "mt-bench", "--device", "cpu",
                                                       "--out", "{results}", phrase="not a draftsmith validate output",
                                                       unchanged=("{results}", "{export}")),
    "validate-out-holds-the-drafter": validate("--drafter", "{export}", "--dataset", "mt-bench", "--device", "cpu",
                                               "--out", "{export}", phrase="this command's input; refusing to replace it",
                                               unchanged=("{export}",)),
    "train-overwrite-into-project-folder": train("out_dir={project}", "--overwrite", phrase="not a draftsmith run",
                                                 unchanged=("{project}", "{run}")),
    "train-into-project-folder-says-not-a-run": train("out_dir={project}", phrase="not a draftsmith run",
                                                      unchanged=("{project}",)),
    "train-resume-into-project-folder": train("out_dir={project}", "--resume", "{run}/checkpoints/last.ckpt",
                                              phrase="not a draftsmith run", unchanged=("{project}", "{run}")),
    "regenerate-out-another-tools-folder": regenerate(*R[:-1], "{results}", phrase="not written by regenerate",
                                                      unchanged=("{results}",)),
    # ---- damaged exports are refused when read, by every command that serves them
    "generate-nan-export": generate("--prompt", "hi", *G, "--drafter", "{nanexport}", phrase="holds NaN or Inf values"),
    "validate-nan-export": validate("--drafter", "{nanexport}", "--dataset", "mt-bench", "--device", "cpu", "--out",
                                    "{fresh}", phrase="holds NaN or Inf values"),
    "bench-nan-export": bench(*B, "--drafter", "{nanexport}", "--num-prompts", "1", phrase="holds NaN or Inf values"),
    "generate-int-export": generate("--prompt", "hi", *G, "--drafter", "{intexport}",
                                    phrase="tensor norm.weight is int32, not floating point"),
    "validate-int-export": validate("--drafter", "{intexport}", "--dataset", "mt-bench", "--device", "cpu", "--out",
                                    "{fresh}", phrase="tensor norm.weight is int32, not floating point"),
    "bench-int-export": bench(*B, "--drafter", "{intexport}", "--num-prompts", "1",
                              phrase="tensor norm.weight is int32, not floating point"),
    "generate-weights-not-as-recorded": generate("--prompt", "hi", *G, "--drafter", "{editedexport}",
                                                 phrase="draftsmith.json records (the weights were changed"),
    "validate-weights-not-as-recorded": validate("--drafter", "{editedexport}", "--dataset", "mt-bench", "--device", "cpu",
                                                 "--out", "{fresh}", phrase="draftsmith.json records (the weights were changed"),
    "bench-weights-not-as-recorded": bench(*B, "--drafter", "{editedexport}", "--num-prompts", "1",
                                           phrase="draftsmith.json records (the weights were changed"),
    "generate-zero-byte-safetensors": generate("--prompt", "hi", *G, "--drafter", "{zeroexport}",
                                               phrase="model.safetensors: not a readable safetensors file"),
    "validate-zero-byte-safetensors": validate("--drafter", "{zeroexport}", "--dataset", "mt-bench", "--device", "cpu",
                                               "--out", "{fresh}", phrase="model.safetensors: not a readable safetensors"),
    "bench-zero-byte-safetensors": bench(*B, "--drafter", "{zeroexport}", "--num-prompts", "1",
                                         phrase="model.safetensors: not a readable safetensors file"),
    "generate-truncated-export-safetensors": generate("--prompt", "hi", *G, "--drafter", "{cutexport}",
                                                      phrase="model.safetensors: not a readable safetensors file"),
    "validate-truncated-export-safetensors": validate("--drafter", "{cutexport}", "--dataset", "mt-bench", "--device",
                                                      "cpu", "--out", "{fresh}",
                                                      phrase="model.safetensors: not a readable safetensors file"),
    "bench-truncated-export-safetensors": bench(*B, "--drafter", "{cutexport}", "--num-prompts", "1",
                                                phrase="model.safetensors: not a readable safetensors file"),
    "validate-another-target": validate(*V, "--target", "{othertarget}", "--num-prompts", "1",
                                        phrase="was trained against; pass --accept-other-target"),
    "generate-another-target": generate("--prompt", "hi", "--target", "{othertarget}", "--device", "cpu", "--drafter",
                                        "{export}", phrase="was trained against; pass --accept-other-target"),
    "bench-another-target": bench("--target", "{othertarget}", "--device", "cpu", "--out", "{fresh}", "--drafter",
                                  "{export}", "--num-prompts", "1", phrase="was trained against; pass --accept-other-target"),
    # ---- values that were accepted and then failed (or ran out of memory)
    "generate-temperature-inf": generate("--prompt", "hi", *G, "--temperature", "inf",
                                         phrase="--temperature: must be a finite number, got inf"),
    "generate-temperature-nan": generate("--prompt", "hi", *G, "--temperature", "nan",
                                         phrase="--temperature: must be a finite number, got nan"),
    "validate-temperature-inf": validate(*V, "--temperature", "inf", phrase="--temperature: must be a finite number"),
    "regenerate-temperature-inf": regenerate(*R, "--temperature", "inf", phrase="--temperature: must be a finite number"),
    "validate-tolerance-inf": validate(*V, "--tolerance", "inf", phrase="--tolerance: must be a finite number"),
    "bench-tree-too-large": bench(*B, "--tree", "50,50,5000", phrase="--tree 50,50,5000: at most depth 32 and 1024 nodes"),
    "validate-tree-too-large": validate(*V, "--tree", "50,50,5000", phrase="--tree 50,50,5000: at most depth 32"),
    "train-seed-too-large": train("seed=4294967296", phrase="seed: must be an integer in [0, 4294967295]"),
    "train-devices-beyond-the-machine": train("trainer.devices=512", phrase="trainer.devices: 512 is more than this machine has"),
    "train-lr-that-diverges": train("optim.lr=1e6", "out_dir={fresh}-diverged", phrase="became NaN or Inf"),
    # ---- tracebacks that are one line now
    "train-max-length-cuts-every-answer": train("data.max_length=8", phrase="no training conversations left"),
    "train-heldout-fraction-holds-everything": train("data.heldout_fraction=0.999", phrase="no training conversations left"),
    "train-batch-larger-than-the-data": train("data.batch_size=500", phrase="data.batch_size 500: the"),
    "train-folder-of-markdown-as-dataset": train("data.dataset={mdfolder}", phrase="notes-md: a folder Hugging Face datasets "
                                                 "cannot read"),
    "generate-non-utf8-prompt": generate("--prompt", "caf\udce9", *G, phrase="--prompt: not UTF-8 text (byte 0xe9)"),
    "validate-prompt-is-a-list": validate("--drafter", "{export}", "--dataset", "{listprompt}", "--device", "cpu",
                                          "--out", "{fresh}", phrase="row 1: `prompt` must be a string, got list"),
    "validate-category-null": validate("--drafter", "{export}", "--dataset", "{nullcategory}", "--device", "cpu",
                                       "--out", "{fresh}", phrase="row 1: `category` must be a string, got null"),
    "validate-no-prompt-field": validate("--drafter", "{export}", "--dataset", "{noprompt}", "--device", "cpu",
                                         "--out", "{fresh}", phrase="row 1 has no `prompt` (a string)"),
    "bench-prompt-is-a-list": bench(*B, "--dataset", "{listprompt}", phrase="row 1: `prompt` must be a string, got list"),
    "bench-category-null": bench(*B, "--dataset", "{nullcategory}", phrase="`category` must be a string, got null"),
    "bench-no-prompt-field": bench(*B, "--dataset", "{noprompt}", phrase="has no `prompt` (a string) and no `messages`"),
    "validate-prompts-folder": validate("--drafter", "{export}", "--dataset", "{mdfolder}", "--device", "cpu",
                                        "--out", "{fresh}", phrase="a folder; prompts come from a JSON or JSONL file"),
    "promise-without-arguments": promise(phrase="the following arguments are required: export"),
    "promise-unknown-flag": promise("{export}", "eval.k=2", "--frobnicate", phrase="unrecognized arguments: --frobnicate"),
    # ---- train.extract (the feature store's writer)
    "extract-out-under-a-file": extract("--out", "{userfile}/store", phrase="is a file, not a folder"),
    "extract-out-user-folder": extract("--out", "{userdir}", phrase="is not a feature store python -m train.extract wrote"),
    "extract-out-is-a-file": extract("--out", "{userfile}", phrase="is not a feature store python -m train.extract wrote"),
    "extract-bad-dtype": extract("--out", "{fresh}", "--dtype", "fp16", phrase="invalid choice: 'fp16'"),
    "extract-unknown-flag": extract("--out", "{fresh}", "--frobnicate", phrase="unrecognized arguments: --frobnicate"),
}
CASES.update(ISSUE_52)
