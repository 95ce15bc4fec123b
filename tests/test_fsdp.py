"""trainer.strategy=fsdp (train/fsdp.py): FSDP2 over the drafter alone. On the CPU with gloo:
which modules are sharded, the optimizer-state keys, one sharded training step against the
same step unsharded for every method, and (slow) whole runs: world size 1 and 2 against the
unsharded runs, resume, single-process reload and export. A GPU test repeats the first on CUDA
in bf16-mixed (skipped without CUDA)."""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.conftest import overfit_one_batch, tiny_overrides, train_at_once
from train.fsdp import ShardingError, is_sharded, keyed_by_index, keyed_by_name, shard_drafter, shard_units


def _drafter_and_target(name: str):
    from models.methods import method
    from models.target import Target
    from train.config import DrafterConfig

    hf = Target.load("tiny-random-llama", []).model.config
    vd = 256
    row = method(name)
    small = {"dflash": dict(layers=1, block_size=4, target_layers=2), "medusa": dict(heads=3), "mtp": dict(modules=2)}
    options = row.options(**small.get(name, {})) if row.options is not None else None
    drafter = row.build(DrafterConfig(method=name, draft_vocab_size=vd, options=options), hf, vd, 0)
    target = Target.load("tiny-random-llama", drafter.aux_layer_ids)
    d2t = torch.arange(vd) * 3 - torch.arange(vd)  # draft row i is target token 3i
    t2d = torch.zeros(hf.vocab_size, dtype=torch.bool)
    t2d[torch.arange(vd) * 3] = True
    drafter.init_from_target(target.model, d2t, t2d)
    return drafter, target


# ----------------------------------------------------------------------------- pure parts
@pytest.mark.parametrize("name", ["eagle3", "eagle1", "medusa", "mtp", "dflash"])
def test_units_are_drafter_modules_covering_each_parameter_once(name):
    drafter, target = _drafter_and_target(name)
    units = shard_units(drafter)
    inside = {id(m) for m in drafter.modules()}
    assert units and all(id(u) in inside for u in units)
    assert not any(isinstance(u, (nn.ModuleList, nn.ModuleDict)) for u in units)
    owned = [id(p) for u in units for p in u.parameters()]
    assert sorted(owned) == sorted(id(p) for p in drafter.parameters())  # each exactly once
    assert not {id(p) for p in target.parameters()} & set(owned)  # the target is never a unit
    assert all(len({p.dtype for p in u.parameters()}) == 1 for u in units)


def test_parameters_outside_modules_or_mixed_dtypes_are_refused():
    class Loose(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))
            self.fc = nn.Linear(3, 3)

    with pytest.raises(ShardingError, match="outside its modules \\(scale\\)"):
        shard_units(Loose())

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)])
            self.layers[1].bias.data = self.layers[1].bias.data.bfloat16()

    with pytest.raises(ShardingError, match="drafter module layers.1 mixes parameter dtypes"):
        shard_units(Mixed())


def test_optimizer_state_keys_round_trip_as_torch_keys_them():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": trained[:2]}, {"params": trained[2:], "lr": 0.1}])
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    by_index = opt.state_dict()
    names = ["0.weight", "1.weight", "1.bias"]  # the optimizer's order, frozen 0.bias left out
    by_name = keyed_by_name(by_index, names)
    assert list(by_name["state"]) == names and by_name["param_groups"][1]["params"] == ["1.bias"]
    again = keyed_by_index(by_name)
    assert again["param_groups"] == by_index["param_groups"]
    assert all(torch.equal(again["state"][i]["exp_avg"], by_index["state"][i]["exp_avg"]) for i in range(3))
    with pytest.raises(KeyError, match="holds 3 parameters, this drafter trains 2"):
        keyed_by_name(by_index, names[:2])


# ----------------------------------------------------------------------------- one process, gloo
@pytest.fixture()
def gloo_world_of_one(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["eagle3", "eagle1", "medusa", "mtp", "dflash"])
def test_a_sharded_drafter_trains_as_the_unsharded_one(name, gloo_world_of_one):
    from train.config import EvalConfig, ObjectiveConfig, OptimConfig
    from train.fsdp import gathered_drafter
    from train.module import DrafterModule

    plain, target = _drafter_and_target(name)
    sharded = copy.deepcopy(plain)
    shard_drafter(sharded, gloo_world_of_one)
    shard_drafter(sharded, gloo_world_of_one)  # a second call (trainer.validate after fit) changes nothing
    assert is_sharded(sharded) and not is_sharded(plain) and not is_sharded(target)
    objective = ObjectiveConfig(ttt_steps=3, block_anchors=4)
    losses = []
    for d in (plain, sharded):
        module = DrafterModule(target, d, objective, OptimConfig(), EvalConfig(k=2, anchors_per_sequence=4), 100)
        losses.append(overfit_one_batch(module, d, 3, length=24, vocab=target.config.vocab_size, reseed=1)[1])
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    gathered = gathered_drafter(sharded)
    assert type(gathered) is type(plain) and not is_sharded(gathered)
    full = gathered.state_dict()
    assert list(full) == list(plain.state_dict())
    for key, tensor in plain.state_dict().items():
        torch.testing.assert_close(full[key], tensor, rtol=1e-4, atol=1e-4)  # Adam (lr 3e-3) on float32 noise


# ----------------------------------------------------------------------------- whole runs
def _train(args, *extra):
    res = subprocess.run([sys.executable, "-m", "train", *args, *extra], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]


def _checkpoint(out):
    return torch.load(out / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")


def _assert_same_run(a, b, atol=1e-6):
    """Same checkpoint keys and format, tensors equal within `atol` (float32 noise by default),
    same export."""
    from safetensors.torch import load_file

    ca, cb = _checkpoint(a), _checkpoint(b)
    assert ca["global_step"] == cb["global_step"] and sorted(ca) == sorted(cb)
    assert list(ca["state_dict"]) == list(cb["state_dict"])
    assert all(cb["state_dict"][k].shape == v.shape and cb["state_dict"][k].dtype == v.dtype for k, v in ca["state_dict"].items())
    # every tensor's largest difference in the message, not only the first one over (one tensor
    # named cannot say where the runs parted)
    diffs = {k: (cb["state_dict"][k].float() - v.float()).abs().max().item() for k, v in ca["state_dict"].items()
             if v.is_floating_point() and v.numel()}
    over = {k: d for k, d in diffs.items()
            if not torch.allclose(cb["state_dict"][k].float(), ca["state_dict"][k].float(), rtol=1e-4, atol=atol)}
    assert not over, "tensors differ (largest difference of each): " + ", ".join(f"{k} {d:.3g}" for k, d in diffs.items())
    assert all(torch.equal(cb["state_dict"][k], v) for k, v in ca["state_dict"].items() if not v.is_floating_point())
    oa, ob = ca["optimizer_states"][0], cb["optimizer_states"][0]
    assert [g["params"] for g in oa["param_groups"]] == [g["params"] for g in ob["param_groups"]]
    assert list(oa["state"]) == list(ob["state"])
    ea, eb = load_file(a / "export" / "model.safetensors"), load_file(b / "export" / "model.safetensors")
    assert list(ea) == list(eb)
    for k, v in ea.items():
        torch.testing.assert_close(eb[k].float(), v.float(), rtol=1e-2, atol=1e-2)  # bf16 export


@pytest.mark.slow
def test_fsdp_on_one_process_equals_a_plain_run_resumes_and_exports(chat_file, tmp_path):
    plain, fsdp = tmp_path / "plain", tmp_path / "fsdp"
    short = {"trainer.max_steps": 4, "checkpoint_every_n_steps": 2}
    train_at_once(tiny_overrides(chat_file, plain, **short), [*tiny_overrides(chat_file, fsdp, **short), "trainer.strategy=fsdp"],
                   one_thread=True)
    _assert_same_run(plain, fsdp)
    # both resume to step 6 (the FSDP checkpoint under FSDP) and still agree
    train_at_once([*tiny_overrides(chat_file, plain, **short), "trainer.max_steps=6", "--resume"],
                   [*tiny_overrides(chat_file, fsdp, **short), "trainer.strategy=fsdp", "trainer.max_steps=6", "--resume"],
                   one_thread=True)
    _assert_same_run(plain, fsdp)
    # the FSDP checkpoint exports on its own and passes the check
    res = subprocess.run([sys.executable, "-m", "export", "--checkpoint", str(fsdp / "checkpoints" / "last.ckpt"),
                          "--out", str(tmp_path / "again")], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    res = subprocess.run([sys.executable, "-m", "export.check", str(tmp_path / "again")], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and "export OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.slow
def test_fsdp_on_two_gloo_processes_equals_ddp_and_reloads_on_one(two_process_runs, tmp_path):
    import shutil

    overrides, runs = two_process_runs  # 2-process DDP and FSDP runs of 4 steps (conftest)
    ddp, fsdp = runs["ddp"], runs["fsdp"]
    _assert_same_run(ddp, fsdp)
    # the 2-process FSDP checkpoint resumes on one process without FSDP (a copy: the runs are shared)
    shutil.copytree(fsdp, tmp_path / "fsdp")
    _train(overrides(tmp_path / "fsdp"), "trainer.max_steps=5", "--resume")
    assert _checkpoint(tmp_path / "fsdp")["global_step"] == 5


# ----------------------------------------------------------------------------- on a GPU
def _adam_reach(run, steps: int) -> float:
    """How far two bf16-mixed runs from the same weights on the same batches can drift apart in
    `steps` AdamW steps, whatever order their kernels reduce in: each step moves a parameter by
    lr_t * |m_hat| / (sqrt(v_hat) + eps), at most ~lr_t for these betas (a bound of 3 lr_t is
    taken), so two runs part by at most 2 * 3 * sum(lr_t) <= 6 * steps * lr (weight decay 0 here).
    bf16 noise cannot take them further apart; a larger gap is another start or other data."""
    import yaml

    optim = yaml.safe_load((run / "config.yaml").read_text())["optim"]
    assert not optim.get("weight_decay"), optim
    return 6 * steps * optim["lr"]


def _assert_bf16_runs_agree(a, b, steps: int):
    """_assert_same_run's structure (keys, dtypes, optimizer state), tensors within `_adam_reach`."""
    reach = _adam_reach(a, steps)
    ca, cb = _checkpoint(a), _checkpoint(b)
    assert ca["global_step"] == cb["global_step"] == steps and list(ca["state_dict"]) == list(cb["state_dict"])
    diffs = {k: (cb["state_dict"][k].float() - v.float()).abs().max().item() for k, v in ca["state_dict"].items()
             if v.is_floating_point() and v.numel()}
    assert max(diffs.values()) <= reach, (f"beyond what {steps} AdamW steps can move ({reach:.3g}): "
                                          + ", ".join(f"{k} {d:.3g}" for k, d in diffs.items()))
    oa, ob = ca["optimizer_states"][0], cb["optimizer_states"][0]
    assert [g["params"] for g in oa["param_groups"]] == [g["params"] for g in ob["param_groups"]]
    assert list(oa["state"]) == list(ob["state"])


@pytest.mark.slow
def test_fsdp_on_one_process_equals_a_plain_run_in_bf16_mixed_on_cpu(chat_file, tmp_path):
    """The GPU case's premise where it can run here: bf16-mixed (autocast) on the CPU, FSDP over
    gloo against the plain run. Seen bit-identical."""
    plain, fsdp = tmp_path / "plain", tmp_path / "fsdp"
    short = {"trainer.max_steps": 4, "checkpoint_every_n_steps": 2}
    train_at_once([*tiny_overrides(chat_file, plain, **short), "trainer.precision=bf16-mixed"],
                  [*tiny_overrides(chat_file, fsdp, **short), "trainer.precision=bf16-mixed", "trainer.strategy=fsdp"],
                  one_thread=True)
    _assert_bf16_runs_agree(plain, fsdp, 4)
    _assert_same_run(plain, fsdp)  # and, on the CPU, within float32 noise


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDP on CUDA needs a GPU (the CPU cases run gloo)")
def test_fsdp_on_one_gpu_equals_a_plain_run_in_bf16(chat_file, tmp_path):
    """bf16 kernels need not reduce in the same order twice, so the runs are held to what AdamW
    can make of such noise (`_adam_reach`), not to float32 equality. Checked after one step too:
    a gap there is no drift but another start (initial weights, batches)."""
    plain, fsdp = tmp_path / "plain", tmp_path / "fsdp"
    gpu = {"trainer.max_steps": 4, "checkpoint_every_n_steps": 1, "trainer.accelerator": "gpu", "trainer.devices": 1}
    _train(tiny_overrides(chat_file, plain, **gpu), "trainer.precision=bf16-mixed")
    _train(tiny_overrides(chat_file, fsdp, **gpu), "trainer.precision=bf16-mixed", "trainer.strategy=fsdp")
    first = {name: torch.load(run / "checkpoints" / "step1.ckpt", weights_only=True, map_location="cpu")["state_dict"]
             for name, run in (("plain", plain), ("fsdp", fsdp))}
    after_one = max((first["plain"][k].float() - v.float()).abs().max().item() for k, v in first["fsdp"].items()
                    if v.is_floating_point() and v.numel())
    assert after_one <= _adam_reach(plain, 1), f"{after_one:.3g} apart after one step: the runs did not start alike"
    _assert_bf16_runs_agree(plain, fsdp, 4)
