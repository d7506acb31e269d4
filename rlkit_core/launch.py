"""How a run is launched, as one value built at the edge.

A recipe's batch sizes are global and split over the processes; FSDP, DeepSpeed and the
launcher's mixed precision decide what can run. Those facts come from how the run was started
(`accelerate launch`, `torchrun`, an accelerate config file) and from the machine (a GPU or not).
`Launch` holds them, built once (`Launch.from_environment`, `Launch.from_accelerate_config`) and
passed to `parse_recipe`, the plan and the trainer, so that the same TOML with the same `Launch`
gives the same result wherever it is read; components read it as `BuildContext.launch`.
`Launch()` is one process on a machine without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import attrs
import torch

from rlkit_core.config import greater_than
from rlkit_core.errors import RlkitError


def _true(value: str | None) -> bool:
    return (value or "").lower() in ("1", "true")


@attrs.frozen
class Launch:
    """How this run is started: what the recipe checks and the trainer's engine need to know."""

    processes: int = attrs.field(default=1, validator=greater_than(0))  # over all machines
    sharded: bool = False  # the accelerate config selects FSDP
    fsdp_version: int = 1  # with `sharded`: the FSDP version it selects (accelerate's default 1; rlkit runs 2 only)
    mixed_precision: str = "no"  # what the launcher asks for ('no' leaves it to the recipe's run.mixed_precision)
    cuda: bool = False  # torch sees a GPU on this machine
    deepspeed: bool = False  # the accelerate config selects DeepSpeed (rlkit does not run it)
    fsdp_offload_params: bool = False  # FSDP options rlkit does not run (untested)
    fsdp_activation_checkpointing: bool = False

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None, cuda: bool | None = None) -> Launch:
        """The launch this process is part of: `accelerate launch` and `torchrun` set WORLD_SIZE,
        accelerate the ACCELERATE_* and FSDP_* variables from its config. `cuda`: whether there
        is a GPU (default: whether torch sees one)."""
        environ = os.environ if environ is None else environ
        return cls(processes=int(environ.get("WORLD_SIZE", "1")),
                   sharded=_true(environ.get("ACCELERATE_USE_FSDP")),
                   fsdp_version=int(environ.get("FSDP_VERSION", "1")),
                   mixed_precision=environ.get("ACCELERATE_MIXED_PRECISION", "no"),
                   cuda=torch.cuda.is_available() if cuda is None else cuda,
                   deepspeed=_true(environ.get("ACCELERATE_USE_DEEPSPEED")),
                   fsdp_offload_params=_true(environ.get("FSDP_OFFLOAD_PARAMS")),
                   fsdp_activation_checkpointing=_true(environ.get("FSDP_ACTIVATION_CHECKPOINTING")))

    @classmethod
    def from_accelerate_config(cls, config_file: str, cuda: bool | None = None) -> Launch:
        """The launch `accelerate launch --config_file config_file` would start (its num_processes)."""
        from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

        try:
            config = load_config_from_file(config_file)
        except (OSError, ValueError, TypeError) as exc:
            raise RlkitError(f"--accelerate-config {config_file}: not an accelerate config file ({exc})") from None
        if not isinstance(config, ClusterConfig):
            raise RlkitError(f"--accelerate-config {config_file}: a SageMaker config, which rlkit does not launch; "
                             "give a config for this machine (configs/accelerate/)")
        engine, fsdp = config.distributed_type.value, config.fsdp_config or {}
        return cls(processes=max(config.num_processes, 1), sharded=engine == "FSDP", fsdp_version=int(fsdp.get("fsdp_version", 1)),
                   mixed_precision=str(config.mixed_precision or "no"), cuda=torch.cuda.is_available() if cuda is None else cuda,
                   deepspeed=engine == "DEEPSPEED", fsdp_offload_params=fsdp.get("fsdp_offload_params") is True,
                   fsdp_activation_checkpointing=fsdp.get("fsdp_activation_checkpointing") is True)


ONE_PROCESS = Launch()  # what a recipe is checked for unless told otherwise
