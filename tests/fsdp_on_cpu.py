"""FSDP on CPUs, for tests: `torchrun ... tests/fsdp_on_cpu.py (worker|rlkit|SCRIPT) ARGS...`.

accelerate runs FSDP only on GPUs: on CPUs its state settles on MULTI_CPU (DDP) before it looks at
the FSDP settings, and rlkit refuses that launch (`distributed.engine_problem`). Everything FSDP
itself needs works on CPUs with gloo (torch's `fully_shard`, the sharded checkpoint through
torch.distributed.checkpoint), so this launcher stands in for the GPU machine: after accelerate
has set up its state it selects FSDP there, with the plugin read from the ACCELERATE_USE_FSDP /
FSDP_* environment that `accelerate launch --config_file configs/accelerate/fsdp.yaml` sets
(`launch_environment`). From then on accelerate's own FSDP code prepares, steps, gathers and
checkpoints, and rlkit's code runs exactly as it would on GPUs. Then it runs
tests/distributed_worker.py (`worker`), the rlkit CLI (`rlkit`) or a script (benchmarks/memory.py).
"""

import os
import runpy
import sys
from pathlib import Path

import accelerate
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

FSDP_CONFIG = Path(__file__).parents[1] / "configs" / "accelerate" / "fsdp.yaml"


def launch_environment(config_file: Path = FSDP_CONFIG) -> dict[str, str]:
    """The ACCELERATE_* and FSDP_* variables `accelerate launch --config_file config_file` sets,
    worked out by accelerate's own launcher code."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(config_file), "script.py"]))
    return {k: v for k, v in prepare_multi_gpu_env(args).items() if k.startswith(("ACCELERATE_", "FSDP_"))}


_original_init = accelerate.Accelerator.__init__


def _init_selecting_fsdp(self, *args, fsdp_plugin=None, **kwargs):
    _original_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if os.environ.get("ACCELERATE_USE_FSDP") == "true" and self.distributed_type == DistributedType.MULTI_CPU:
        # the caller's plugin, else one from the FSDP_* environment, set up as accelerate's state does on GPUs
        plugin = fsdp_plugin or FullyShardedDataParallelPlugin()
        if self.mixed_precision != "no":
            plugin.set_mixed_precision(self.mixed_precision)
        # PartialState's copy too: accelerate re-reads it whenever it builds an AcceleratorState
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
        AcceleratorState._shared_state["fsdp_plugin"] = plugin


def main(kind: str, *args: str) -> None:
    accelerate.Accelerator.__init__ = _init_selecting_fsdp
    sys.path.insert(0, str(Path(__file__).parent))
    if kind == "worker":
        import distributed_worker

        distributed_worker.main(*args)
    elif kind == "rlkit":
        from rlkit_core.runtime.cli import main as rlkit

        sys.exit(rlkit(list(args)))
    else:  # a script, e.g. benchmarks/memory.py
        sys.argv = [kind, *args]
        runpy.run_path(kind, run_name="__main__")


if __name__ == "__main__":
    main(*sys.argv[1:])
