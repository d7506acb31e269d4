# pyright: standard
"""Many processes through accelerate: which share of the work is this process's, and how the
per-process numbers become the global ones the math is defined over.

A single process is the N = 1 case: every function here then returns its input unchanged, so
single-process results do not depend on this module at all.
"""

from __future__ import annotations

import contextlib
import os
import sys

import attrs
import torch
from accelerate.utils import DistributedType, gather_object

from rlkit_core.batch import RolloutBatch
from rlkit_core.errors import RunError
from rlkit_core.interfaces import LossTerms
from rlkit_core.launch import Launch


@attrs.frozen
class StepTerms:
    """An optimiser step's terms under their `train/` names as the loop adds them up over the
    step's micro-batches and processes (`add_terms`, `Processes.combine_terms`): `summed` by their
    sum, `maxed` by their maximum. `LossTerms` says which are which."""

    summed: dict[str, torch.Tensor]  # the losses, their total `loss`, the diagnostics weighted by token share
    maxed: dict[str, torch.Tensor]  # the maxima and `skipped`

    @classmethod
    def share_of(cls, loss: str, terms: LossTerms, token_share: torch.Tensor) -> StepTerms:
        """A micro-batch's share of its step (detached), from what loss `loss` returned:
        diagnostics weighted by the micro-batch's `token_share` of the step's tokens, so that their
        sum is the step's token mean. Terms the loop could not log under their own names are refused."""
        if not isinstance(terms, LossTerms):
            raise RunError(f"loss {loss!r} returned a {type(terms).__name__}; a loss returns rlkit_core.LossTerms")
        if not terms.losses:
            raise RunError(f"loss {loss!r} returned no losses: nothing to optimise")
        if problems := terms.naming_problems():
            raise RunError(f"loss {loss!r} returns terms the loop cannot log: {'; '.join(problems)}; rename them")
        summed = {f"loss_{name}": value.detach() for name, value in terms.losses.items()}
        summed["loss"] = terms.total().detach()
        summed.update((name, value.detach() * token_share) for name, value in terms.diagnostics.items())
        maxed = {name: value.detach() for name, value in terms.maxima.items()}
        maxed["skipped"] = terms.skip.detach()
        return cls(summed, maxed)

    @property
    def loss(self) -> torch.Tensor:
        return self.summed["loss"]

    @property
    def skip(self) -> torch.Tensor:
        return self.maxed["skipped"]

    def metrics(self) -> dict[str, torch.Tensor]:
        return {**self.summed, **self.maxed}


def add_terms(known: StepTerms, terms: StepTerms) -> StepTerms:
    """A micro-batch's terms added into its step's so far: `summed` by their sum, `maxed` by their
    maximum (over processes, `Processes.combine_terms` does the same)."""
    return StepTerms(_merged(known.summed, terms.summed, torch.add), _merged(known.maxed, terms.maxed, torch.maximum))


def _merged(known: dict[str, torch.Tensor], terms: dict[str, torch.Tensor], combine) -> dict[str, torch.Tensor]:
    combined = dict(known)
    for name, value in terms.items():
        combined[name] = value if name not in known else combine(known[name], value)
    return combined


class TrainableModules(torch.nn.Module):
    """Policy and critic as one module for `accelerator.prepare`.

    DDP synchronises gradients only for a forward pass that goes through its wrapper; the loop's
    forward pass reads both the policy and the critic, so it runs inside `forward` here. The
    critic is held as its module (FSDP must reach the module that computes with the parameters
    it shards), or by its parameters when a value head is not one module (DDP needs no more).
    """

    def __init__(self, policy, value_head):
        super().__init__()
        self.policy_model = policy.model
        critic = value_head.module() if value_head is not None else None
        self.critic = critic if critic is not None else torch.nn.ParameterList(value_head.parameters() if value_head else [])
        # FSDP shards each of the policy's units (`Policy.shard_units`) on its own: accelerate finds
        # their classes by the names under this attribute on the module it prepares.
        self._no_split_modules = [unit.__name__ for unit in policy.shard_units()]

    def forward(self, view, *args, **kwargs):
        """`view(*args, **kwargs)`, inside the wrapper's forward (and its autocast under mixed precision)."""
        return view(*args, **kwargs)


class Processes:
    """This process's place among the processes of an `accelerate launch` (or `torchrun`)."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.count = accelerator.num_processes
        self.index = accelerator.process_index
        self.is_main = accelerator.is_main_process
        self.sharded = accelerator.distributed_type == DistributedType.FSDP

    @contextlib.contextmanager
    def full_weights(self, trainable: torch.nn.Module):
        """Inside: every weight of `trainable` whole in every process, as plain tensors.

        Under FSDP each process holds a shard of each weight, and the engine gathers a unit's
        weights only inside the prepared module's own forward pass. Generation, the no-grad
        forward passes and saving read the policy directly, so they run inside this block: every
        unit is gathered once on entry (a collective: every process enters, in the same order)
        and stays whole, however many forward passes run inside, until it is sharded again on
        exit. Without sharding this does nothing."""
        if not self.sharded:
            yield
            return
        from torch.distributed.fsdp import FSDPModule

        with torch.no_grad():
            trainable(_nothing)  # FSDP sets itself up in its root's first forward pass; this one computes nothing
        units = [module for module in trainable.modules() if isinstance(module, FSDPModule)]  # the root first
        resharding = [_reshards_after_forward(unit) for unit in units]
        for unit in units:
            unit.unshard()
            unit.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for unit, reshards in zip(units, resharding):
                unit.set_reshard_after_forward(reshards, recurse=False)
                unit.reshard()

    def share(self, items: list) -> list:
        """This process's contiguous share of a global list; shares in process order make up the list."""
        size = len(items) // self.count
        return items[self.index * size:(self.index + 1) * size]

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over processes of a tensor of the same shape on each."""
        if self.count == 1:
            return tensor
        return self.accelerator.reduce(tensor.clone(), reduction="sum")

    def combine_terms(self, terms: StepTerms) -> StepTerms:
        """Each process's share of an optimiser step's terms -> the step's global terms: the sum
        over processes of `summed`, the maximum of `maxed`."""
        if self.count == 1:
            return terms
        device = self.accelerator.device  # a loss may report a flag on the CPU

        def stacked(values: dict[str, torch.Tensor]) -> torch.Tensor:
            return torch.stack([value.float().to(device) for value in values.values()])

        summed = dict(zip(terms.summed, self.sum(stacked(terms.summed)))) if terms.summed else {}
        maxed = dict(zip(terms.maxed, self.accelerator.gather(stacked(terms.maxed).unsqueeze(0)).max(dim=0).values)) if terms.maxed else {}
        return StepTerms(summed, maxed)

    def gather_batch(self, batch: RolloutBatch, pad_token_id: int) -> RolloutBatch:
        """The global batch: every process's rollouts, in process order, on every process.

        Prompt tensors are left-padded and response tensors right-padded to the widest process;
        the added positions have mask 0, so no masked statistic changes.
        """
        if self.count == 1:
            return batch
        return batch.map_fields(lambda name, value: self._gather_tensor(name, value, pad_token_id),
                                lambda column: gather_object(list(column)))

    def _gather_tensor(self, name: str, value: torch.Tensor, pad_token_id: int) -> torch.Tensor:
        dtype = value.dtype
        if dtype == torch.bool:  # not every backend gathers bool
            value = value.to(torch.uint8)
        if value.dim() == 2:
            pad = pad_token_id if name.endswith("_ids") and name != "group_ids" else 0
            value = self.accelerator.pad_across_processes(value, dim=1, pad_index=pad, pad_first=name.startswith("prompt_"))
        return self.accelerator.gather(value.contiguous()).to(dtype)

    def local_rows(self, whole: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """This process's rows of a tensor of the global batch, cut back to its own [B, R] width."""
        rows = local.shape[0]
        part = whole[self.index * rows:(self.index + 1) * rows]
        return part[:, :local.shape[1]] if local.dim() == 2 else part

    def gather_objects(self, value) -> list:
        """[value of process 0, value of process 1, ...] on every process."""
        if self.count == 1:
            return [value]
        return gather_object([value])

    def wait(self) -> None:
        """Every process reaches this point before any goes on."""
        self.accelerator.wait_for_everyone()

    def exit_together(self) -> None:
        """At the end of a run with several processes: every process waits for the others, then
        ends at once, before Python tears anything down. Tearing down the gloo process group and
        DDP's objects at exit aborted about 1 launch in 16 here (SIGABRT), and could leave a process
        waiting forever on a peer that had already gone; so nothing after this call runs, and
        everything must be written and flushed before it. One process returns as usual."""
        if self.count > 1:
            self.wait()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def _nothing() -> None:
    return None


def _reshards_after_forward(unit) -> bool:
    """Whether an FSDP unit frees its gathered weights after each forward pass (accelerate sets
    this per unit; torch keeps it only inside the unit's parameter groups, private state that
    torch 2.4 to 2.14 have: a torch without it is refused by name rather than with a traceback)."""
    try:
        groups = unit._get_fsdp_state()._fsdp_param_groups
        return any(group.post_forward_mesh_info is not None for group in groups)
    except AttributeError as exc:
        raise RunError(f"torch {torch.__version__}'s FSDP2 no longer keeps the per-unit state rlkit reads to gather the weights "
                       f"whole ({exc}); use a torch in pyproject.toml's range") from None


def engine_problem(accelerator, launch: Launch) -> str | None:
    """What is wrong with the engine accelerate set up for this launch, if anything: the recipe
    was checked for another number of processes, rlkit shards with FSDP2 only, and accelerate runs
    FSDP only on GPUs (on CPUs it silently falls back to DDP, which would not shard anything the
    user planned to fit by sharding)."""
    if accelerator.num_processes != launch.processes:
        return (f"the recipe was checked for {launch.processes} process(es), but this launch has {accelerator.num_processes}; "
                "check and run it for the launch it runs in (rlkit_core.Launch.from_environment)")
    if not launch.sharded:
        return None
    if accelerator.distributed_type != DistributedType.FSDP:
        return (f"the accelerate config selects FSDP, but accelerate runs FSDP on GPUs only and chose "
                f"{accelerator.distributed_type.value} here; on CPUs launch with configs/accelerate/ddp.yaml or torchrun")
    if accelerator.state.fsdp_plugin.fsdp_version != 2:
        return "rlkit runs FSDP version 2 only (fully_shard); set fsdp_version: 2 as configs/accelerate/fsdp.yaml does"
    return None


def critic_problem(value_head) -> str | None:
    """Why FSDP cannot shard this critic, if it cannot: it needs the one module that computes the
    values with the parameters (`ValueHead.module`)."""
    if value_head is None or value_head.module() is not None:
        return None
    return (f"the value head {type(value_head).__name__} is not one module (ValueHead.module returns None), which FSDP "
            "needs to shard it; launch with configs/accelerate/ddp.yaml, or return the module from module()")


def fsdp_plugin(mixed_precision: str, launch: Launch):
    """accelerate's FSDP plugin for this launch (None without FSDP: accelerate's defaults stand).

    Under mixed precision accelerate would have FSDP cast the weights it gathers, the prepared
    module's outputs and the gradient reduction to the low precision. rlkit reads the gathered
    weights outside that module too (generation, the no-grad passes), and the outputs are the
    update's log-probs, which the PPO ratio compares with float32 ones; so FSDP casts nothing
    here, and the forward passes compute in the low precision under accelerate's autocast, as
    they do without FSDP."""
    if not launch.sharded:
        return None
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # the rest from the FSDP_* settings accelerate launch passes on
    return FullyShardedDataParallelPlugin(mixed_precision_policy=MixedPrecisionPolicy() if mixed_precision != "no" else None)


class SideProcesses(Processes):
    """The same processes over a process group of their own, for the collectives a second thread
    runs beside the main one's (a scheduler's producer gathering scores while the update all-reduces
    gradients): each group's collectives then come in the same order in every process."""

    def __init__(self, processes: Processes):
        super().__init__(processes.accelerator)
        # made by every process, in the same order, from its main thread
        self.group = torch.distributed.new_group(backend="gloo") if self.count > 1 else None

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.count == 1:
            return tensor
        total = tensor.detach().cpu().clone()
        torch.distributed.all_reduce(total, group=self.group)
        return total.to(tensor.device)

    def gather_objects(self, value) -> list:
        if self.count == 1:
            return [value]
        gathered: list = [None] * self.count
        torch.distributed.all_gather_object(gathered, value, group=self.group)
        return gathered
