# pyright: standard
"""Producer workers in processes of their own: `[scheduler] workers = "processes"`.

With threads (the default) a worker samples inside the trainer's process, from a deep copy of the
weights, sharing its cores' scheduler and Python's interpreter lock with the update. A process
worker is a spawned process that builds the recipe's components itself (its own policy, generator,
reward and environment: a reward model or a vLLM engine is loaded there, not in the trainer) and
makes the batches it is asked for. The trainer's side (`ProcessWorker`) is what the producer's
thread for that worker calls: it sends the iteration's records and, when the version changed, the
weights, and waits on a pipe for the batch, so the thread holds no lock while the batch is made.

Weights travel through shared memory: at a push the trainer copies its state into one flat buffer
per dtype (`pack`), and the worker copies them into its model before the batch (`unpack`); nothing
else is shared, so the update never writes what a worker reads. A worker process that dies (its
exit code, and the signal that killed it), fails to start (its message) or fails to load weights
ends the run as a thread worker's failure does; one that hangs is a stall (`wait_timeout_s`). A
worker gets SIGTERM when the trainer's process dies (Linux's PR_SET_PDEATHSIG), SIGKILL included,
and the trainer ends it when the producer closes.
"""

from __future__ import annotations

import contextlib
import pickle
import signal
import traceback
from multiprocessing.connection import Connection

import torch

from rlkit_core.child_processes import end_with_parent
from rlkit_core.errors import Problem, RecipeError, RlkitError, RunError
from rlkit_core.launch import ONE_PROCESS
from rlkit_core.randomness import SEED_STRIDE
from rlkit_core.recipe.document import Recipe
from rlkit_core.runtime.faults import BadReward

END_WAIT_S = 5.0  # how long a closing worker gets to exit before it is killed
WORKER_SEEDS = 7_927  # worker w's torch seed is run.seed + SEED_STRIDE * (WORKER_SEEDS + w) + the iteration it starts at

Packed = tuple[dict[torch.dtype, torch.Tensor], list[tuple[str, torch.dtype, int, tuple[int, ...]]]]


def pack(state: dict[str, torch.Tensor]) -> Packed:
    """The tensors of `state` copied into one flat buffer per dtype (one shared-memory segment
    each, not one per tensor), with where each tensor lies in its buffer."""
    layout, sizes = [], {}
    for name, tensor in state.items():
        layout.append((name, tensor.dtype, sizes.get(tensor.dtype, 0), tuple(tensor.shape)))
        sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + tensor.numel()
    device = next(iter(state.values())).device if state else torch.device("cpu")
    buffers = {dtype: torch.empty(size, dtype=dtype, device=device) for dtype, size in sizes.items()}
    with torch.no_grad():
        for (_, dtype, offset, _), tensor in zip(layout, state.values()):
            buffers[dtype][offset:offset + tensor.numel()].copy_(tensor.reshape(-1))
    return buffers, layout


def unpack(packed: Packed) -> dict[str, torch.Tensor]:
    """The state `pack` packed, as views of its buffers."""
    buffers, layout = packed
    return {name: buffers[dtype][offset:offset + _numel(shape)].view(shape) for name, dtype, offset, shape in layout}


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


class WorkerDied(RunError):
    """A worker process ended, or its pipe broke, while the trainer waited on it."""


class ProcessWorker:
    """The trainer's side of one worker process (see the module)."""

    def __init__(self, recipe: Recipe, number: int, first: int, device: torch.device, threads: int):
        context = torch.multiprocessing.get_context("spawn")
        self.number = number
        self.connection, theirs = context.Pipe()
        self.process = context.Process(target=serve, args=(recipe, number, first, device, threads, theirs),
                                       name=f"rlkit-producer-{number}", daemon=True)
        try:
            self.process.start()
        except (pickle.PicklingError, AttributeError, TypeError) as exc:  # the recipe, its components' classes among it
            raise RecipeError([Problem("$.scheduler.workers", f"workers = 'processes' sends the recipe to each worker process, and it "
                                       f"cannot be sent ({type(exc).__name__}: {exc}): a component class defined where another "
                                       "process cannot import it (inside a function, or made at run time); register it from a "
                                       "module's top level, or leave workers out")]) from None
        finally:
            theirs.close()

    def wait_ready(self, timeout: float) -> None:
        """Until the worker has built its components; raises what stopped it."""
        if not self.connection.poll(timeout):
            raise WorkerDied(f"the producer's worker process {self.number} did not build the recipe's components within "
                             f"scheduler.wait_timeout_s = {timeout:g} s")
        self._answer()

    def rollout(self, iteration: int, version: int, weights: Packed | None, records: list[dict], max_prompt_tokens: int):
        """The batch of `iteration` and its metrics, made in the worker's process; `weights`: those
        after `version` updates, to load first (None: it holds them already)."""
        try:
            self.connection.send((iteration, version, weights, records, max_prompt_tokens))
        except (BrokenPipeError, ConnectionResetError, EOFError):
            raise WorkerDied(self._ended()) from None
        return self._answer()

    def _answer(self):
        try:
            kind, *rest = self.connection.recv()
        except (EOFError, ConnectionResetError, OSError):
            raise WorkerDied(self._ended()) from None
        if kind == "bad_reward":
            raise BadReward(*rest)
        if kind == "recipe_error":
            raise RecipeError(*rest)
        if kind == "failed":
            raise WorkerDied(f"its process raised {rest[0]}")
        return rest[0] if kind == "ready" else tuple(rest)

    def _ended(self) -> str:
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        if code is None:
            return f"its process {self.process.pid} stopped answering"
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return f"its process {self.process.pid} {how}"

    def close(self, wait: bool) -> None:
        """End the worker: asked to stop (`wait`: given `END_WAIT_S` to do so), then killed."""
        with contextlib.suppress(OSError):
            self.connection.send(None)
        self.process.join(timeout=END_WAIT_S if wait else 0.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=END_WAIT_S)
        self.connection.close()


class WorkerEngine:
    """What stage 1 reads of an engine, in a worker process: one process, whole weights, the run's autocast."""

    def __init__(self, recipe: Recipe, device: torch.device):
        from rlkit_core.runtime.engine import start_accelerator
        from rlkit_core.runtime.push_check import PushCheck

        self.accelerator, self.processes, self.device = start_accelerator(recipe, ONE_PROCESS, device)
        self.push_check = PushCheck(recipe.health.weight_push_tolerance)

    def full_weights(self):
        return contextlib.nullcontext()

    def autocast(self):
        return self.accelerator.autocast()


def serve(recipe: Recipe, number: int, first: int, device: torch.device, threads: int, connection: Connection) -> None:
    """A worker process's life: build the components, then make each batch asked for until told to stop."""
    from rlkit_core.context import BuildContext
    from rlkit_core.recipe.assemble import build_components
    from rlkit_core.runtime import rollout

    end_with_parent()
    torch.set_num_threads(threads)
    run = recipe.run
    try:
        torch.manual_seed(run.seed + SEED_STRIDE * (WORKER_SEEDS + number) + first)
        engine = WorkerEngine(recipe, device)
        context = BuildContext(recipe=recipe, device=device, output_dir=run.output_dir, seed=run.seed, launch=ONE_PROCESS)
        components = build_components(recipe, context)
        components.policy.model.requires_grad_(False)
    except BaseException as exc:  # a located error as it is; anything else with where it came from
        where = "" if isinstance(exc, RlkitError) else "\n" + traceback.format_exc()
        connection.send(("failed", f"{type(exc).__name__} while building the recipe's components: {exc}{where}"))
        return
    connection.send(("ready", None))
    while (request := _request(connection)) is not None:
        iteration, version, weights, records, max_prompt_tokens = request
        doing = "loading the pushed weights"
        try:
            if weights is not None:
                components.policy.model.load_state_dict(unpack(weights))
                components.policy.weights_version = version
                del weights  # the shared segments are freed once no process holds them
            doing = "making the batch"
            with torch.no_grad():
                batch, metrics = rollout.rollout(engine, components, recipe, records, recipe.ppo.samples_per_prompt, max_prompt_tokens)
            answer = ("made", batch, metrics)
        except BadReward as exc:
            answer = ("bad_reward", exc.problem, exc.batch)
        except RecipeError as exc:
            answer = ("recipe_error", exc.problems, exc.source)
        except BaseException as exc:
            answer = ("failed", f"{type(exc).__name__} while {doing}: {exc}")
        connection.send(answer)


def _request(connection: Connection):
    """The next request, or None: told to stop, or the trainer's end of the pipe closed."""
    try:
        return connection.recv()
    except (EOFError, OSError):
        return None
