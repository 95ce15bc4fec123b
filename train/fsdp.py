"""`trainer.strategy=fsdp`: FSDP2 (`fully_shard`) over the drafter alone.

Lightning's FSDP (FSDP1) wraps the whole LightningModule and flattens the frozen bf16 target and
the float32 drafter into one flat parameter, which fails ("Must flatten tensors with uniform
dtype"). Here the target stays an ordinary module (frozen, replicated on each rank, as under
DDP) and only the drafter's modules are sharded, each with its own uniform dtype.

Each *child* module of the drafter that holds parameters is one FSDP unit; the drafter itself
is not: the training module calls its methods (`unroll`, `features`, ...) rather than its
`forward`, and FSDP gathers a unit's parameters only around that unit's own forward. Every
child is called through its forward (a Linear, a norm, a decoder layer). Each unit is its own
FSDP root, so it keeps its gathered parameters from its first forward of a step until its
backward has reduce-scattered the gradients: during a step the whole drafter is gathered, as
under DDP, and what sharding saves is the optimizer state and the float32 master weights and
gradients between steps.

Checkpoints and the export see the full parameters: a checkpoint written under FSDP holds the
same keys and tensors as a DDP run's (optimizer state keyed by index, as `Optimizer.state_dict`
keys it), so it loads on one process with `weights_only=True`, resumes under either strategy,
and exports with `python -m export --checkpoint`.
"""
from __future__ import annotations

from torch import nn

PREFIX = "drafter."


class ShardingError(ValueError):
    """A drafter whose parameters cannot be split into FSDP units (see `shard_units`)."""


# ----------------------------------------------------------------- which modules are units
def shard_units(drafter: nn.Module) -> list[nn.Module]:
    """The drafter's modules to shard, one FSDP unit each: every child that holds parameters,
    looking inside containers (ModuleList / ModuleDict have no forward of their own). The
    drafter may hold no parameter directly (nothing would gather it around a method call), and
    a unit's parameters must share one dtype (FSDP all-gathers a unit in one buffer)."""
    own = [name for name, _ in drafter.named_parameters(recurse=False)]
    if own:
        raise ShardingError(f"{type(drafter).__name__} holds parameters outside its modules ({', '.join(own)}); "
                            "FSDP would only gather them around its forward, which training does not call")
    units = []
    for name, child in drafter.named_children():
        units += _units_of(child, name)
    for name, unit in units:
        dtypes = {p.dtype for p in unit.parameters()}
        if len(dtypes) > 1:
            raise ShardingError(f"drafter module {name} mixes parameter dtypes {sorted(map(str, dtypes))}; "
                                "an FSDP unit must have one")
    return [unit for _, unit in units]


def _units_of(module: nn.Module, name: str) -> list[tuple[str, nn.Module]]:
    if next(module.parameters(), None) is None:
        return []  # nothing to shard (buffers stay whole on every rank)
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return [u for child_name, child in module.named_children() for u in _units_of(child, f"{name}.{child_name}")]
    return [(name, module)]


def is_sharded(module: nn.Module) -> bool:
    """Whether `fully_shard` was applied to `module` or a module inside it. (Not read from the
    parameters: between a unit's forward and its backward they are the gathered plain tensors,
    and after an evaluation, which has no backward, they stay so.)"""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def shard_drafter(drafter: nn.Module, mesh) -> None:
    """fully_shard each unit over the 1-D data-parallel `mesh` (moving it to the mesh's device).
    Idempotent: Lightning calls configure_model again for `trainer.validate` after fit."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for unit in shard_units(drafter):
        if not isinstance(unit, FSDPModule):
            fully_shard(unit, mesh=mesh)


# ----------------------------------------------------------------- full state, gathered
def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_state(drafter: nn.Module) -> dict:
    """The drafter's state dict with full tensors on the CPU of rank 0 ({} on other ranks).
    A collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(drafter, options=_options(cpu_offload=True))


def gathered_drafter(drafter: nn.Module):
    """What the export writes: the drafter itself when it is not sharded; otherwise, on rank
    0, an unsharded copy holding the full parameters (None on other ranks). A collective when
    sharded: every rank must call it."""
    if not is_sharded(drafter):
        return drafter
    state = full_state(drafter)
    if not state:
        return None
    plain = type(drafter)(drafter.config)  # drafters build from their config alone (models/checkpoint.py)
    plain.load_state_dict(state, strict=True)
    return plain.eval()


# ----------------------------------------------------------------- optimizer state keys
def keyed_by_index(state: dict) -> dict:
    """An optimizer state dict keyed by parameter name (as torch.distributed.checkpoint gives
    it) re-keyed by index in the optimizer's parameter order, as `Optimizer.state_dict()` keys
    it: a checkpoint written under FSDP then looks like a DDP run's."""
    if not state:
        return state
    names = [n for group in state["param_groups"] for n in group["params"]]
    index = {n: i for i, n in enumerate(names)}
    return {"state": {index[n]: s for n, s in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}


def keyed_by_name(state: dict, names: list[str]) -> dict:
    """The inverse of `keyed_by_index`: `names` are the optimizer's parameters' names, in its order."""
    count = sum(len(g["params"]) for g in state["param_groups"])
    if count != len(names):
        raise KeyError(f"the checkpoint's optimizer holds {count} parameters, this drafter trains {len(names)}")
    return {"state": {names[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}


def optimizer_names(drafter: nn.Module, optimizer) -> list[str]:
    """The names (in `drafter`) of the optimizer's parameters, in the optimizer's order."""
    name_of = {id(p): n for n, p in drafter.named_parameters()}
    try:
        return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    except KeyError:
        raise ShardingError("the optimizer trains parameters outside the drafter (joint training); "
                            "trainer.strategy=fsdp shards the drafter only") from None


def drafter_state(checkpoint_state: dict) -> dict:
    """The drafter's tensors of a checkpoint's state_dict (drafter.* keys, prefix dropped);
    a KeyError naming any other key (FSDP runs hold the drafter only)."""
    foreign = [k for k in checkpoint_state if not k.startswith(PREFIX)]
    if foreign:
        raise KeyError(f"checkpoint has keys outside the drafter: {foreign[:5]}")
    return {k[len(PREFIX):]: v for k, v in checkpoint_state.items()}


# ----------------------------------------------------------------- the Lightning strategy
def fsdp_strategy():
    """A Lightning strategy for `trainer.strategy=fsdp`: ModelParallelStrategy with every rank
    in one data-parallel dimension (no tensor parallelism), the drafter sharded by the module's
    configure_model, and checkpoints of the full drafter in one file that rank 0 writes through
    the run's CheckpointIO (atomic, read back with weights_only=True)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from models.checkpoint import load_checkpoint

    class DrafterFSDP(ModelParallelStrategy):
        def __init__(self):
            super().__init__(data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=False)

        def setup_environment(self):
            # every process is a data-parallel replica (the parent's "auto" means one per node)
            self._data_parallel_size = self.num_nodes * self.num_processes
            super().setup_environment()

        @property
        def drafter(self):
            return self.lightning_module.drafter

        def lightning_module_state_dict(self):
            return {PREFIX + k: v for k, v in full_state(self.drafter).items()}

        def optimizer_state(self, optimizer):
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's own
            optimizer_names(self.drafter, optimizer)  # refuses an optimizer over more than the drafter
            return keyed_by_index(get_optimizer_state_dict(self.drafter, optimizer, options=_options(cpu_offload=True)))

        def load_checkpoint(self, checkpoint_path, weights_only=None):
            return load_checkpoint(checkpoint_path)  # always weights_only=True, onto the CPU

        def load_model_state_dict(self, checkpoint, strict=True):
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            # every rank holds the full tensors: each keeps its shard of them
            set_model_state_dict(self.drafter, drafter_state(checkpoint["state_dict"]), options=_options(strict=strict))

        @property
        def lightning_restore_optimizer(self):
            return True  # through load_optimizer_state_dict below

        def load_optimizer_state_dict(self, checkpoint):
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
                named = keyed_by_name(state, optimizer_names(self.drafter, optimizer))
                set_optimizer_state_dict(self.drafter, optimizer, named, options=_options())

    return DrafterFSDP()
