"""Recipe validation: every problem located, all of them reported together."""

from pathlib import Path

import pytest

from rlkit_core.errors import RecipeError
from rlkit_core.launch import ONE_PROCESS, Launch
from rlkit_core.recipe.document import apply_overrides, load_recipe, parse_recipe


def problems_of(document, registry, launch=ONE_PROCESS):
    with pytest.raises(RecipeError) as caught:
        parse_recipe(document, registry, launch=launch)
    return caught.value.problems


def test_valid_recipe_structures_every_table(recipe_document, builtin_registry):
    recipe = parse_recipe(recipe_document, builtin_registry)
    assert recipe.run.steps == 2
    assert recipe["kl"].component.name == "adaptive"  # default type when the table is absent
    assert recipe["kl"].config.target == 6.0
    assert recipe["generator"].config.max_new_tokens == 8


def test_typo_key_is_located_with_a_suggestion(recipe_document, builtin_registry):
    recipe_document["run"]["stpes"] = 3
    assert problems_of(recipe_document, builtin_registry) == ["$.run.stpes: unknown key; did you mean 'steps'?"]


def test_wrong_type_is_located(recipe_document, builtin_registry):
    recipe_document["ppo"]["batch_size"] = "sixteen"
    assert problems_of(recipe_document, builtin_registry) == ["$.ppo.batch_size: expected an integer, got 'sixteen' (str)"]


def test_float_for_int_and_bool_for_number_are_refused(recipe_document, builtin_registry):
    recipe_document["ppo"]["epochs"] = 2.5
    recipe_document["optim"]["learning_rate"] = True
    assert problems_of(recipe_document, builtin_registry) == [
        "$.ppo.epochs: expected an integer, got 2.5 (float)",
        "$.optim.learning_rate: expected a number, got True (bool)",
    ]


def test_out_of_range_in_a_component_table(recipe_document, builtin_registry):
    recipe_document["kl"] = {"type": "adaptive", "target": -1}
    assert problems_of(recipe_document, builtin_registry) == ["$.kl.target: must be > 0, got -1.0"]


def test_unknown_type_lists_registered_names_and_closest(recipe_document, builtin_registry):
    recipe_document["kl"] = {"type": "adaptve"}
    assert problems_of(recipe_document, builtin_registry) == [
        "$.kl.type: unknown kl_controller 'adaptve'; registered: adaptive, fixed; did you mean 'adaptive'?"
    ]


def test_all_problems_are_reported_together(recipe_document, builtin_registry):
    recipe_document["run"]["stpes"] = 3
    recipe_document["run"]["seed"] = "zero"
    recipe_document["ppo"]["minibatch_size"] = 5
    recipe_document["kl"] = {"type": "fixed", "beta": -0.1}
    recipe_document["lossy"] = {}
    problems = problems_of(recipe_document, builtin_registry)
    assert problems == [
        "$.lossy: unknown table; did you mean [loss]?",
        "$.run.seed: expected an integer, got 'zero' (str)",
        "$.run.stpes: unknown key; did you mean 'steps'?",
        "$.ppo.minibatch_size: 5 does not divide batch_size=16; pick a divisor such as 4",
        "$.kl.beta: must be >= 0, got -0.1",
    ]


def test_batch_arithmetic(recipe_document, builtin_registry):
    recipe_document["ppo"].update(batch_size=10, samples_per_prompt=4, minibatch_size=20)
    assert problems_of(recipe_document, builtin_registry) == [
        "$.ppo.batch_size: 10 rollouts do not split into groups of samples_per_prompt=4; use a multiple of 4",
        "$.ppo.minibatch_size: 20 is larger than batch_size=10; use a divisor of 10",
    ]


def test_missing_required_table_and_key(recipe_document, builtin_registry):
    del recipe_document["reward"]
    del recipe_document["policy"]["model"]
    problems = problems_of(recipe_document, builtin_registry)
    assert problems[0] == "$.policy.model: required key is missing"
    assert problems[1].startswith("$.reward: this table is required; add [reward] with type = one of ")


def test_overrides_go_through_the_same_validation(recipe_document, builtin_registry, write_recipe):
    path = write_recipe(recipe_document)
    recipe = load_recipe(path, builtin_registry, ["kl.target=4", "run.steps=10", "kl.type=\"adaptive\""])
    assert recipe["kl"].config.target == 4.0 and recipe.run.steps == 10
    with pytest.raises(RecipeError) as caught:
        load_recipe(path, builtin_registry, ["kl.target=-4"])
    assert caught.value.problems == ["$.kl.target: must be > 0, got -4.0"]


def test_override_syntax_errors():
    with pytest.raises(RecipeError) as caught:
        apply_overrides({"run": {"steps": 1}}, ["run.steps", "run.steps.deeper=1"])
    assert caught.value.problems == [
        "--set run.steps: expected KEY=VALUE with a dotted key, such as kl.target=4",
        "--set run.steps.deeper=1: 'steps' is not a table in the recipe",
    ]


def test_override_values_are_toml_literals_or_plain_strings():
    document = apply_overrides({}, ["a.n=4", "a.f=0.5", "a.b=true", "a.s=hello", "a.l=[1, 2]"])
    assert document == {"a": {"n": 4, "f": 0.5, "b": True, "s": "hello", "l": [1, 2]}}


def test_missing_file_and_bad_toml(tmp_path, builtin_registry):
    with pytest.raises(RecipeError, match="no recipe at"):
        load_recipe(tmp_path / "nope.toml", builtin_registry)
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nsteps = 1")
    with pytest.raises(RecipeError, match="not valid TOML"):
        load_recipe(bad, builtin_registry)


def test_batch_arithmetic_over_processes_and_micro_batches(recipe_document, builtin_registry):
    recipe_document["ppo"].update(batch_size=12, minibatch_size=4)
    assert problems_of(recipe_document, builtin_registry, Launch(processes=3)) == [
        "$.ppo.minibatch_size: 4 rollouts do not split evenly over 3 processes; use a multiple of 3",
    ]
    recipe_document["ppo"].update(batch_size=16, minibatch_size=8)
    recipe_document["ppo"]["gradient_accumulation_steps"] = 3
    assert problems_of(recipe_document, builtin_registry, Launch(processes=2)) == [
        "$.ppo.gradient_accumulation_steps: the 4 rollouts of a minibatch in each of 2 processes do not split into "
        "3 micro-batches; pick a divisor such as 2",
    ]
    recipe_document["ppo"]["gradient_accumulation_steps"] = 1
    assert problems_of(recipe_document, builtin_registry, Launch(processes=32))[0].startswith("$.ppo.batch_size: its 16 prompts do not split evenly over 32")


def test_a_launch_config_that_leaves_precision_to_the_recipe_is_not_a_conflict(recipe_document, builtin_registry):
    launch = Launch(mixed_precision="no")  # set by the configs in configs/accelerate/
    recipe_document["run"]["mixed_precision"] = "bf16"
    assert parse_recipe(recipe_document, builtin_registry, launch=launch).run.mixed_precision == "bf16"


def test_launches_that_cannot_work_are_refused_before_anything_starts(recipe_document, builtin_registry):
    launch = Launch(deepspeed=True, mixed_precision="bf16")  # accelerate launch --mixed_precision bf16
    recipe_document["run"].update(mixed_precision="fp16", device="cpu")
    recipe_document["policy"]["dtype"] = "bfloat16"
    problems = problems_of(recipe_document, builtin_registry, launch)
    assert [p.split(":")[0] for p in problems] == ["launch", "launch", "$.run.mixed_precision", "$.run.mixed_precision"]
    assert "DeepSpeed" in problems[0] and "configs/accelerate/fsdp.yaml" in problems[0]
    assert "--set run.mixed_precision=bf16" in problems[1]
    assert "needs a GPU" in problems[2] and "policy.dtype = 'bfloat16'" in problems[3]


def test_what_fsdp_does_not_run_is_refused_before_anything_starts(recipe_document, builtin_registry):
    launch = Launch(sharded=True, fsdp_version=2)  # what accelerate launch starts from an FSDP config
    recipe_document["policy"]["lora_r"] = 4
    parse_recipe(recipe_document, builtin_registry, launch=launch)  # float32 weights, full or LoRA, with the hf generator run
    launch = Launch(sharded=True, fsdp_version=1, fsdp_offload_params=True, fsdp_activation_checkpointing=True)
    recipe_document["policy"]["dtype"] = "bfloat16"
    recipe_document["generator"]["type"] = "vllm"
    problems = problems_of(recipe_document, builtin_registry, launch)
    assert [p.split(":")[0] for p in problems] == ["launch", "launch", "launch", "$.policy.dtype", "$.generator.type"]
    assert "fsdp_version: 2" in problems[0] and "fsdp_offload_params: true" in problems[1]
    assert "policy.gradient_checkpointing" in problems[2] and "run.mixed_precision = 'bf16'" in problems[3]
    assert "'hf' generator" in problems[4] and "configs/accelerate/ddp.yaml" in problems[4]


def test_the_launch_is_read_from_the_variables_accelerate_launch_and_torchrun_set():
    assert Launch.from_environment({}, cuda=False) == Launch() == ONE_PROCESS
    environ = {"WORLD_SIZE": "4", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "ACCELERATE_MIXED_PRECISION": "bf16",
               "ACCELERATE_USE_DEEPSPEED": "false", "FSDP_OFFLOAD_PARAMS": "true", "FSDP_ACTIVATION_CHECKPOINTING": "false"}
    assert Launch.from_environment(environ, cuda=True) == Launch(processes=4, sharded=True, fsdp_version=2, mixed_precision="bf16",
                                                                 cuda=True, fsdp_offload_params=True)
    assert Launch.from_environment({"ACCELERATE_USE_DEEPSPEED": "1"}, cuda=False).deepspeed


def test_the_launch_of_an_accelerate_config_file_is_the_one_accelerate_launch_would_start():
    configs = Path(__file__).parents[1] / "configs" / "accelerate"
    assert Launch.from_accelerate_config(str(configs / "fsdp.yaml"), cuda=False) == Launch(processes=2, sharded=True, fsdp_version=2)
    assert Launch.from_accelerate_config(str(configs / "ddp.yaml"), cuda=False) == Launch(processes=2)


def test_the_same_document_parses_the_same_for_the_same_launch_whatever_the_environment(recipe_document, builtin_registry,
                                                                                        monkeypatch):
    recipe_document["ppo"].update(batch_size=12, minibatch_size=4)
    quiet = parse_recipe(recipe_document, builtin_registry)
    monkeypatch.setenv("WORLD_SIZE", "3")  # read by Launch.from_environment only, never while parsing
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert parse_recipe(recipe_document, builtin_registry) == quiet
    assert problems_of(recipe_document, builtin_registry, Launch.from_environment())[0].startswith("$.ppo.minibatch_size: 4 rollouts")


def test_constant_schedule_with_warmup_points_to_the_schedule_that_has_one(recipe_document, builtin_registry):
    recipe_document["optim"].update(schedule="constant", warmup_steps=10)
    assert problems_of(recipe_document, builtin_registry) == [
        "$.optim.warmup_steps: the 'constant' schedule has no warm-up; use schedule = 'constant_with_warmup'"]


def test_every_schedule_the_recipe_accepts_builds_in_transformers():
    import torch
    from transformers import get_scheduler

    from rlkit_core.records import SCHEDULES

    for name in SCHEDULES:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = get_scheduler(name, optimizer, num_warmup_steps=2, num_training_steps=10)
        for _ in range(10):
            optimizer.step()
            scheduler.step()  # steps without a metric, as the trainer does
        assert 0.0 <= scheduler.get_last_lr()[0] <= 1.0, name


def test_problems_are_located_records(builtin_registry):
    from rlkit_core.errors import Problem
    from rlkit_core.recipe.document import structure_table
    from rlkit_core.records import RunConfig

    _, problems = structure_table({"stpes": 1}, RunConfig, "$.run")
    assert problems == [Problem("$.run.steps", "required key is missing"),
                        Problem("$.run.stpes", "unknown key; did you mean 'steps'?")]
    assert str(problems[0]) == "$.run.steps: required key is missing"
