# pyright: standard
"""`rlkit export`: a checkpoint → a plain transformers model directory that `from_pretrained` loads."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from rlkit_core.context import BuildContext
from rlkit_core.errors import RlkitError
from rlkit_core.launch import ONE_PROCESS, Launch
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.recipe.registry import Registry
from rlkit_core.runtime import checkpoint


def export_checkpoint(path: str, out: str, registry: Registry, merge_lora: bool = False, launch: Launch = ONE_PROCESS) -> Path:
    """Rebuild the policy the checkpoint's recipe describes, load the trained tensors, save it.

    With LoRA, `merge_lora` folds the adapters into the base weights; without it the adapters are
    saved on their own (peft's layout), which is smaller but needs peft to load. The checkpoint's
    recipe is checked for `launch`.
    """
    source = checkpoint.resolve(path, ".", resuming=False)  # the weights' files are the same in every layout
    target = Path(out)
    if target.exists() and any(target.iterdir()):
        raise RlkitError(f"rlkit export: {target} exists and is not empty; choose a new folder")
    recipe = parse_recipe(checkpoint.read_meta(source)["recipe"], registry, str(source / "meta.json"), launch)
    context = BuildContext(recipe=recipe, device=torch.device("cpu"), output_dir=str(target), seed=recipe.run.seed)
    choice = recipe["policy"]
    policy = choice.component.factory(choice.config, context)
    policy.load_state_dict(load_file(source / "policy.safetensors"))
    policy.save_pretrained(str(target), merge_adapters=merge_lora)
    return target
