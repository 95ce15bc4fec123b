"""Every bad-config case is one clear line naming the key, exit code 2, before any model loads."""
import subprocess
import sys

import pytest

from train.config import ConfigError, load_config

CASES = [
    (["data.batchsize=3"], "unknown key 'data.batchsize' (did you mean data.batch_size?)"),
    (["bogus=1"], "unknown key 'bogus'"),
    (["trainer.max_stepz=3"], "unknown key 'trainer.max_stepz' (did you mean trainer.max_steps?)"),
    (["data.batch_size=abc"], "data.batch_size: expected an integer, got 'abc'"),
    (["drafter.eagle3.norm_before_residual=maybe"], "drafter.eagle3.norm_before_residual: expected true or false"),
    (["optim.lr=fast"], "optim.lr: expected a number"),
    (["drafter.aux_layer_ids=[1,2,30]"], "drafter.aux_layer_ids[2]: layer 30 is out of range for the 30-layer target (0..29)"),
    (["data.dataset=/no/such/file.jsonl"], "data.dataset: '/no/such/file.jsonl' is not a zoo data set or an existing file"),
    (["target=/no/such/folder"], "target: '/no/such/folder' is not a zoo target"),
    (["data.batch_size=0"], "data.batch_size: must be a positive integer"),
    (["drafter.method=medusa9"], "drafter.method: 'medusa9' is not available"),
    (["optim.schedule_by=epochs"], "optim.schedule_by: 'epochs' is not one of steps, time"),
    (["trainer.strategy=fsdp_cpu_offload"], "trainer.strategy: 'fsdp_cpu_offload' is not supported (use fsdp"),
    (["trainer.strategy=fsdp", "drafter.method=mtp", "eval.k=3", "objective.joint=true"],
     "trainer.strategy: fsdp shards the drafter only, and objective.joint trains the target too; use ddp"),
    (["optim.schedule_by=time"], "optim.schedule_by=time: trainer.max_time must be set as DD:HH:MM:SS, got None"),
    # tree promises: [depth, top_k, total_tokens] the runtime can draft, each once, EAGLE-3 only
    (["eval.trees=[[3,0,4]]"], "eval.trees: must be a list of [depth, top_k, total_tokens] or [depth, top_k, "
                               "total_tokens, children], positive integers"),
    (["eval.trees=[[2,2,7]]"], "total_tokens at most the top_k + (depth - 1) * top_k * children candidates"),
    (["eval.trees=[[2,2,5,1]]"], "total_tokens at most the top_k + (depth - 1) * top_k * children candidates"),
    (["eval.trees=[[2,2,4,0]]"], "eval.trees: must be a list of"),
    (["eval.trees=[[2,2,4,1,1]]"], "eval.trees: must be a list of"),
    (["eval.trees=[[2,2,4],[2,2,4,2]]"], "eval.trees: [[2, 2, 4], [2, 2, 4, 2]] lists a tree twice"),
    (["eval.trees=[[2,2]]"], "eval.trees: must be a list of [depth, top_k, total_tokens]"),
    (["eval.trees=[[2,x,4]]"], "eval.trees[0][1]: expected an integer"),
    (["eval.trees=[[2,2,4],[2,2,4]]"], "eval.trees: [[2, 2, 4], [2, 2, 4]] lists a tree twice"),
    (["drafter.method=medusa", "eval.k=3", "eval.trees=[[2,2,4]]"], "eval.trees: draft trees are drafted by eagle3"),
]


@pytest.mark.parametrize("overrides,message", CASES)
def test_bad_config_is_a_config_error(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config("configs/quickstart.yaml", overrides)
    assert message in str(e.value)


@pytest.mark.parametrize("argv,message", [
    (["data.batchsize=3"], "unknown key 'data.batchsize'"),
    (["--config", "configs/nope.yaml"], "--config: file configs/nope.yaml does not exist"),
    (["--resume", "/no/such.ckpt"], "--resume: checkpoint /no/such.ckpt does not exist"),
    (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["drafter.aux_layer_ids=[40]"], "layer 40 is out of range"),
])
def test_cli_prints_one_line_and_exits_2(argv, message):
    res = subprocess.run([sys.executable, "-m", "train", *argv], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.stderr
    assert "Traceback" not in res.stderr


def test_print_config_shows_resolved_values():
    res = subprocess.run([sys.executable, "-m", "train", "--print-config", "data.batch_size=7"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "batch_size: 7" in res.stdout and "target: smollm2-135m-instruct" in res.stdout


def test_recipes_parse():
    for name in ("quickstart", "eagle3"):
        cfg = load_config(f"configs/{name}.yaml", [])
        assert cfg.drafter.method == "eagle3"


def test_aux_layer_ids_must_be_strictly_increasing():
    """vLLM sorts and de-duplicates aux ids and SGLang captures in layer order: an unsorted
    list would train on one feature order and be served another."""
    import pytest

    from train.config import ConfigError, load_config

    for ids in ("[14,1,26]", "[1,1,26]"):
        with pytest.raises(ConfigError, match="strictly increasing"):
            load_config(None, [f"drafter.aux_layer_ids={ids}"])


def test_trainer_keys_read_from_lightnings_source_are_its_signatures():
    """A recipe's trainer.* keys are checked against lightning.Trainer's arguments read from the
    installed source (no 6-8 s import of lightning for a bad key): the same set the signature has."""
    import inspect

    import lightning

    from train.config import _trainer_keys_from_source
    assert _trainer_keys_from_source() == set(inspect.signature(lightning.Trainer.__init__).parameters)


def test_a_config_stored_with_the_old_flat_method_keys_still_loads_and_resumes(tmp_path):
    """Checkpoints, exports and run folders written before drafter.<method> sections hold flat
    keys (drafter.medusa_heads, ... every method's): stored configs are upgraded (the method's
    own keys moved into its section, the others dropped), while a user's old key is one line
    naming the new one."""
    import pytest
    import yaml

    from train.config import ConfigError, config_from_dict, load_config
    from train.run_folder import _check_same_run

    flat = {"method": "medusa", "aux_layer_ids": None, "draft_vocab_size": 256, "norm_before_residual": False,
            "norm_before_fc": False, "fc_bias": True, "medusa_heads": 3, "medusa_layers": 2, "mtp_modules": 3,
            "dflash_block_size": 8, "dflash_layers": 5, "dflash_mask_token_id": None, "dflash_target_layers": 5}
    stored = {"target": "tiny-random-llama", "drafter": flat, "eval": {"k": 3}, "trainer": {"max_steps": 1}}
    cfg = config_from_dict(stored, [])
    assert cfg.drafter.method == "medusa" and (cfg.drafter.options.heads, cfg.drafter.options.layers) == (3, 2)
    assert cfg.to_dict()["drafter"] == {"method": "medusa", "aux_layer_ids": None, "draft_vocab_size": 256,
                                        "medusa": {"heads": 3, "layers": 2}}
    with pytest.raises(ConfigError, match=r"unknown key 'drafter.medusa_heads' \(it is drafter.medusa.heads now\)"):
        load_config(None, ["drafter.method=medusa", "drafter.medusa_heads=3"])

    (tmp_path / "config.yaml").write_text(yaml.safe_dump(stored))  # a run folder of an older version
    _check_same_run(tmp_path, cfg.to_dict())  # the same run: resumable
    other = config_from_dict(stored, ["drafter.medusa.heads=4"]).to_dict()
    with pytest.raises(ConfigError, match=r"different drafter.medusa.heads \(3 there, 4 now\)"):
        _check_same_run(tmp_path, other)
