# pyright: standard
"""The engine: what runs the math on the hardware, built once per run.

It holds accelerate's accelerator, this process's place among the processes, the policy and
critic prepared as one module, the optimiser and its schedule, and the tensors the optimiser
updates. The stages call it for what depends on how the run is launched (one process, DDP,
FSDP): reading the weights whole, backward, clipping, the optimiser and schedule steps.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from accelerate import Accelerator
from transformers import get_scheduler

from rlkit_core.errors import RunError
from rlkit_core.launch import ONE_PROCESS, Launch
from rlkit_core.recipe.document import Recipe
from rlkit_core.runtime.distributed import Processes, TrainableModules, engine_problem, fsdp_plugin
from rlkit_core.runtime.push_check import PushCheck


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RunError(f"run.device = {name!r} but torch sees no GPU; use 'auto' or 'cpu'")
    return torch.device(name)


def start_accelerator(recipe: Recipe, launch: Launch, device: torch.device | None = None) -> tuple[Accelerator, Processes, torch.device]:
    """accelerate's engine for `launch`, this process's place, and the device the components
    are built on (with several processes on GPUs: this process's own)."""
    run = recipe.run
    device = device or pick_device(run.device)
    # accelerate owns the processes, backward, gradient clipping and mixed precision, so one
    # process and `accelerate launch` (several) go through the same calls.
    # Components are built on device; `prepare` must not move them (run.device = "cuda:1").
    # The schedule steps once per `scheduler.step()` (not once per process, accelerate's default).
    accelerator = Accelerator(cpu=device.type == "cpu", mixed_precision=run.mixed_precision, device_placement=False,
                              fsdp_plugin=fsdp_plugin(run.mixed_precision, launch), step_scheduler_with_optimizer=False)
    if problem := engine_problem(accelerator, launch):
        raise RunError(problem)
    processes = Processes(accelerator)
    if processes.count > 1 and device.type == "cuda":
        device = accelerator.device  # this process's own GPU
    return accelerator, processes, device


class RolloutEngine(Protocol):
    """What stage 1 (`rlkit_core.runtime.rollout`, the episodes) reads of an engine: the run's
    `Engine`, or a scheduler worker's `SideEngine` (`rlkit_core.runtime.scheduling`), which
    samples beside the update and has no optimiser to offer."""

    @property
    def device(self) -> torch.device: ...

    @property
    def processes(self) -> Processes: ...

    def full_weights(self) -> AbstractContextManager[object]: ...

    def autocast(self) -> AbstractContextManager[object]: ...

    # the comparison after each weight push to a generator with weights of its own (one per generator)
    push_check: PushCheck

    def between_turns(self) -> bool:
        """Called between an episode batch's turns: load weights pushed since the batch began, if
        the run takes them there (a producer's worker with `scheduler.partial_rollouts`); whether
        the weights changed."""
        ...


class SamplingEngine:
    """The part of a `RolloutEngine` that samples beside the update or apart from it (a producer's
    worker, `rlkit check`'s episodes): its weights are whole, so reading them whole is nothing to
    do, and `newer_weights`, when set (`scheduler.partial_rollouts`), loads the weights pushed
    meanwhile and says whether there were any (`between_turns`)."""

    newer_weights: Callable[[], bool] | None = None

    def full_weights(self):
        return contextlib.nullcontext()

    def between_turns(self) -> bool:
        return self.newer_weights() if self.newer_weights is not None else False


class StandaloneEngine(SamplingEngine):
    """What stage 1 reads of an engine in a process that trains nothing (`rlkit check`'s episodes,
    a producer's worker process): one process (or a worker's group: `launch`), the run's mixed precision."""

    def __init__(self, recipe: Recipe, device: torch.device | None = None, launch: Launch = ONE_PROCESS):
        self.accelerator, self.processes, self.device = start_accelerator(recipe, launch, device)
        self.push_check = PushCheck(recipe.health.weight_push_tolerance)

    def autocast(self):
        return self.accelerator.autocast()


class Engine:
    """The prepared policy and critic with their optimiser and schedule (see the module)."""

    def __init__(self, recipe: Recipe, accelerator: Accelerator, processes: Processes, device: torch.device, policy, value_head):
        run, ppo, optim = recipe.run, recipe.ppo, recipe.optim
        self.accelerator, self.processes, self.device = accelerator, processes, device
        self.push_check = PushCheck(recipe.health.weight_push_tolerance)
        groups = [{"params": list(policy.parameters()), "lr": optim.learning_rate}]
        if value_head is not None:
            groups.append({"params": list(value_head.parameters()), "lr": optim.value_learning_rate or optim.learning_rate})
        # fused: one kernel for all parameters (2 ms a step instead of 10 on the benchmark shape's CPU);
        # the same update up to rounding, also on FSDP2's DTensor shards
        optimizer = torch.optim.AdamW(groups, weight_decay=optim.weight_decay, eps=optim.adam_eps,
                                      fused=device.type in ("cpu", "cuda"))
        self.trainable, self.optimizer = accelerator.prepare(TrainableModules(policy, value_head), optimizer)
        # what the optimiser updates: the same tensors, or under FSDP the shards that replaced them
        self.parameters = [p for g in optimizer.param_groups for p in g["params"]]
        updates = run.steps * ppo.epochs * (ppo.batch_size // ppo.minibatch_size)
        # prepared, so that accelerate's save_state holds it with the optimiser, loss scaler and random states
        self.scheduler = accelerator.prepare(get_scheduler(optim.schedule, optimizer, num_warmup_steps=optim.warmup_steps,
                                                           num_training_steps=updates))

    def full_weights(self):
        """A block in which the policy and critic can be read whole (under FSDP: gathered in every
        process, which must all enter it; see `Processes.full_weights`)."""
        return self.processes.full_weights(self.trainable)

    def autocast(self):
        """The run's mixed precision, for passes that do not go through the prepared module."""
        return self.accelerator.autocast()

    def between_turns(self) -> bool:
        return False  # the module being trained changes only between rollouts

    def no_sync(self):
        """A block whose backward passes keep their gradients local (all-reduced at a later one)."""
        return self.accelerator.no_sync(self.trainable)

    def backward(self, loss: torch.Tensor) -> None:
        # DDP averages gradients over processes; the loss is a share of a global sum, so undo the mean.
        self.accelerator.backward(loss * self.processes.count)

    def clip_gradients(self, max_norm: float) -> float:
        """Clip the gradients to `max_norm` (0: no clipping); returns their norm before clipping."""
        # a float: under FSDP the norm is a sharded tensor
        norm = self.accelerator.clip_grad_norm_(self.parameters, max_norm or float("inf"))
        return float(norm)  # pyright: ignore[reportArgumentType]  (None only under DeepSpeed, which rlkit does not launch)

    def step_optimizer(self) -> None:
        self.optimizer.step()

    def step_schedule(self) -> None:
        # A skipped step uses up its place in the schedule on purpose. torch warns of that at the schedule's
        # first step only, and only that step is wrapped: a warnings filter set at every step would reset
        # Python's record of the warnings already shown, and they would be shown again.
        if getattr(self.scheduler.scheduler, "_step_count", 1) > 1:
            return self.scheduler.step()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`")
            self.scheduler.step()

    @property
    def learning_rate(self) -> float:
        return self.scheduler.get_last_lr()[0]
