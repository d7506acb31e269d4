"""The checks of a recipe against the launch it is for (`rlkit_core.launch.Launch`), found before anything is built."""

from __future__ import annotations

import torch

from rlkit_core.errors import Problem
from rlkit_core.launch import Launch


def launch_problems(run, policy_config, launch: Launch) -> list[Problem]:
    """Combinations of recipe and launch that cannot work, each located, found before anything
    is built. `run` is the recipe's RunConfig."""
    problems = device_problems(run.device, launch.cuda)
    if launch.deepspeed:
        problems.append(Problem("launch", "the accelerate config selects DeepSpeed, which rlkit does not run (untested: accelerate "
                                          "runs it on GPUs only); to shard weights, gradients and optimiser state use "
                                          "configs/accelerate/fsdp.yaml (FSDP2, as ZeRO-3), otherwise configs/accelerate/ddp.yaml"))
    # 'no' is also what a config file that leaves precision to the recipe (configs/accelerate/) sets
    if launch.mixed_precision not in ("no", run.mixed_precision):
        problems.append(Problem("launch", f"accelerate launch asks for mixed precision {launch.mixed_precision!r} but "
                                          f"$.run.mixed_precision = {run.mixed_precision!r}; the recipe decides (it is what the run "
                                          f"records): set --set run.mixed_precision={launch.mixed_precision}, or launch without "
                                          "--mixed_precision"))
    if run.mixed_precision == "fp16":
        if run.device == "cpu" or not launch.cuda:
            problems.append(Problem("$.run.mixed_precision", "'fp16' needs a GPU (on a CPU accelerate would quietly run float32); "
                                                             "use 'bf16' or 'no'"))
        if policy_config.dtype != "float32":
            problems.append(Problem("$.run.mixed_precision", f"'fp16' keeps float32 master weights and scales the loss, but "
                                                             f"policy.dtype = {policy_config.dtype!r}; set policy.dtype = 'float32', "
                                                             "or run.mixed_precision = 'no' for pure low-precision weights"))
    return problems


def sharding_problems(policy_config, generator, launch: Launch) -> list[Problem]:
    """What rlkit cannot run under FSDP (a launch whose accelerate config selects it). `generator`
    is the checked component table."""
    if not launch.sharded:
        return []
    problems = []
    if launch.fsdp_version != 2:
        problems.append(Problem("launch", f"the accelerate config selects FSDP version {launch.fsdp_version}; rlkit runs FSDP "
                                          "version 2 (fully_shard) only: set fsdp_version: 2, as configs/accelerate/fsdp.yaml does"))
    untested = {"fsdp_offload_params": launch.fsdp_offload_params, "fsdp_activation_checkpointing": launch.fsdp_activation_checkpointing}
    for key in [key for key, on in untested.items() if on]:
        problems.append(Problem("launch", f"the accelerate config sets {key}: true, which rlkit does not run (untested); "
                                          "set it to false (for activation checkpointing use policy.gradient_checkpointing)"))
    if policy_config.dtype != "float32":
        problems.append(Problem("$.policy.dtype", f"{policy_config.dtype!r} weights are not run under FSDP (untested); "
                                                  "keep policy.dtype = 'float32' and set run.mixed_precision = 'bf16' for bf16 compute"))
    if not generator.component.factory.runs_under_fsdp:
        problems.append(Problem("$.generator.type", f"{generator.component.name!r} is not run under FSDP (it reads the weights "
                                                    "outside the engine); use the 'hf' generator, or launch with "
                                                    "configs/accelerate/ddp.yaml"))
    return problems


def device_problems(device: str, cuda: bool) -> list[Problem]:
    """`run.device` that is not a device, or a GPU on a launch without one."""
    if device == "auto":
        return []
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        return [Problem("$.run.device", f"{device!r} is not a device; use 'auto', 'cpu', 'cuda' or 'cuda:N'")]
    if kind == "cuda" and not cuda:
        return [Problem("$.run.device", f"{device!r} needs a GPU, and torch sees none here; use 'auto' or 'cpu'")]
    return []
