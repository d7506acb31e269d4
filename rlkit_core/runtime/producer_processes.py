# pyright: standard
"""Producer workers in processes of their own: `[scheduler] workers = "processes"`.

With threads (the default) a worker samples inside the trainer's process, from a deep copy of the
weights, sharing its cores' scheduler and Python's interpreter lock with the update. A process
worker is a spawned process that builds the recipe's components itself (its own policy, generator,
reward and environment: a reward model or a vLLM engine is loaded there, not in the trainer) and
makes the batches it is asked for. The trainer's side (`ProcessWorker`) is what the producer's
thread for that worker calls: it sends the iteration's records and, when the version changed, the
weights, and waits on a pipe for the batch, so the thread holds no lock while the batch is made.

A worker builds every component but the critic, which only the update reads.

Weights travel through shared memory: at a push the trainer copies its state into one flat buffer
per dtype (`pack`), and the worker copies them into its model before the batch (`unpack`) and
checks each tensor's sum against the pushed one's (`load`); nothing else is shared, so the update
never writes what a worker reads. With `scheduler.partial_rollouts` each push is also offered on a
second pipe, which the worker reads between its batch's turns (`Pushes`). A worker process that dies (its
exit code, and the signal that killed it), fails to start (its message) or fails to load weights
ends the run as a thread worker's failure does; one that hangs is a stall (`wait_timeout_s`). A
worker gets SIGTERM when the trainer's process dies (Linux's PR_SET_PDEATHSIG), SIGKILL included,
and the trainer ends it when the producer closes.

Under several trainer processes (DDP) each runs its own workers, and worker w of every trainer
process joins a process group of their own (`WorkerGroup`, at the trainer's index), over which
its batch's collectives run (the scores' problems, the episodes' gathered statuses), as a thread
worker's run over a group beside the update's.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import sys
import threading
import traceback
from multiprocessing.connection import Connection

import attrs
import torch

from rlkit_core.child_processes import end_with_parent
from rlkit_core.errors import Problem, RecipeError, RlkitError, RunError
from rlkit_core.launch import ONE_PROCESS, Launch
from rlkit_core.randomness import SEED_STRIDE
from rlkit_core.recipe.document import Recipe
from rlkit_core.runtime.faults import BadReward
from rlkit_core.runtime.push_check import WeightPushFailed

END_WAIT_S = 5.0  # how long a closing worker gets to exit before it is killed
START_WAIT_S = 600.0  # the least time a worker gets to build the components (scheduler.wait_timeout_s if longer)
ENGINE_PROCESSES = 256  # the trainer processes whose workers' engines are seeded apart (`worker_seed`)
# worker w's torch seed: run.seed + SEED_STRIDE * (WORKER_SEEDS + trainer processes * w + its trainer's index) + its first iteration
WORKER_SEEDS = 7_927


def worker_seed(seed: int, number: int) -> int:
    """The run seed worker `number`'s components are built with (`BuildContext.seed`): an engine of
    their own (vLLM) seeds its sampling from it plus SEED_STRIDE times the trainer process's index,
    so this keeps every worker's apart from the trainer's and from each other's, for up to
    ENGINE_PROCESSES trainer processes (within vLLM's 32-bit seeds: 15 workers, run seeds below 1e8)."""
    return seed + SEED_STRIDE * ENGINE_PROCESSES * (number + 1)


@attrs.frozen
class Packed:
    """A state dict as one flat buffer per dtype (one shared-memory segment each, not one per
    tensor), where each tensor lies in its buffer, and each tensor's sum, by which the worker checks
    what it loaded."""

    buffers: dict[torch.dtype, torch.Tensor]
    layout: list[tuple[str, torch.dtype, int, tuple[int, ...]]]  # (name, dtype, offset, shape)
    sums: torch.Tensor  # float64, a tensor's sum each, in the layout's order


def pack(state: dict[str, torch.Tensor]) -> Packed:
    """The tensors of `state` copied into shared buffers (`Packed`)."""
    layout, sizes = [], {}
    for name, tensor in state.items():
        layout.append((name, tensor.dtype, sizes.get(tensor.dtype, 0), tuple(tensor.shape)))
        sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + tensor.numel()
    device = next(iter(state.values())).device if state else torch.device("cpu")
    buffers = {dtype: torch.empty(size, dtype=dtype, device=device) for dtype, size in sizes.items()}
    with torch.no_grad():
        for (_, dtype, offset, _), tensor in zip(layout, state.values()):
            buffers[dtype][offset:offset + tensor.numel()].copy_(tensor.reshape(-1))
    return Packed(buffers, layout, sums(state))


def unpack(packed: Packed) -> dict[str, torch.Tensor]:
    """The state `pack` packed, as views of its buffers."""
    return {name: packed.buffers[dtype][offset:offset + _numel(shape)].view(shape) for name, dtype, offset, shape in packed.layout}


def sums(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each tensor's sum, in float64 on the CPU."""
    with torch.no_grad():
        return torch.stack([tensor.double().sum() for tensor in state.values()]).cpu() if state else torch.zeros(0, dtype=torch.float64)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


@attrs.frozen
class WorkerGroup:
    """Where worker processes of the same number meet under several trainer processes: one at each
    trainer's index, over TCP at `address:port` (a port of their own, free on the first trainer
    process's machine)."""

    address: str
    port: int
    index: int
    count: int

    def join(self) -> Launch:
        """Set this process's launch variables to the group's (the trainer's are inherited: its
        accelerate would join the trainers' group), and say the launch it is part of. A worker
        samples whole weights, so it never shards."""
        os.environ.update(MASTER_ADDR=self.address, MASTER_PORT=str(self.port), RANK=str(self.index), WORLD_SIZE=str(self.count),
                          ACCELERATE_USE_FSDP="false")
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # else the group would meet in torchrun's store, at the trainers' port
        return Launch(processes=self.count)


def worker_groups(processes, workers: int) -> list[WorkerGroup | None]:
    """Each worker's group under several trainer processes (`Processes`; a collective: every trainer
    process calls it, from its main thread), None each under one."""
    if processes.count == 1:
        return [None] * workers
    ports = processes.gather_objects(_free_ports(workers) if processes.is_main else None)[0]
    address = os.environ.get("MASTER_ADDR", "127.0.0.1")
    return [WorkerGroup(address, port, processes.index, processes.count) for port in ports]


def _free_ports(count: int) -> list[int]:
    """`count` distinct ports free on this machine now (held together while chosen)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for each in sockets:
            each.bind(("", 0))
        return [each.getsockname()[1] for each in sockets]


class WorkerDied(RunError):
    """A worker process ended, or its pipe broke, while the trainer waited on it."""


class ProcessWorker:
    """The trainer's side of one worker process (see the module)."""

    def __init__(self, recipe: Recipe, number: int, first: int, device: torch.device, threads: int, group: WorkerGroup | None = None):
        context = torch.multiprocessing.get_context("spawn")
        self.number = number
        self.connection, theirs = context.Pipe()
        # weights pushed while a batch is in flight (`scheduler.partial_rollouts`), sent by a thread of their own: a worker
        # that stops reading blocks that thread, never the trainer
        pushes, self.pushes = context.Pipe(duplex=False)
        self.latest: tuple[int, Packed] | None = None
        self.offered = threading.Condition()
        self.closed = False
        self.reaping = threading.Lock()  # the producer's thread (a broken pipe) and `close` both wait for the process to end
        self.process = context.Process(target=serve, args=(recipe, number, first, device, threads, theirs, pushes, group),
                                       name=f"rlkit-producer-{number}", daemon=True)
        partial = recipe.scheduler.partial_rollouts
        self.sender = threading.Thread(target=self._send_pushes, name=f"rlkit-producer-{number}-pushes", daemon=True) if partial else None
        try:
            self.process.start()
        except (pickle.PicklingError, AttributeError, TypeError) as exc:  # the recipe, its components' classes among it
            raise RecipeError([Problem("$.scheduler.workers", f"workers = 'processes' sends the recipe to each worker process, and it "
                                       f"cannot be sent ({type(exc).__name__}: {exc}): a component class defined where another "
                                       "process cannot import it (inside a function, or made at run time); register it from a "
                                       "module's top level, or leave workers out")]) from None
        finally:
            theirs.close()
            pushes.close()
        if self.sender is not None:
            self.sender.start()

    def wait_ready(self, timeout: float) -> None:
        """Until the worker has built its components (given at least `START_WAIT_S`: importing torch
        and building models or an engine may take longer than a batch); raises what stopped it."""
        timeout = max(timeout, START_WAIT_S)
        if not self.connection.poll(timeout):
            raise WorkerDied(f"the producer's worker process {self.number} did not build the recipe's components within {timeout:g} s")
        self._answer()

    def rollout(self, iteration: int, version: int, weights: Packed | None, records: list[dict], max_prompt_tokens: int):
        """The batch of `iteration` and its metrics, made in the worker's process; `weights`: those
        after `version` updates, to load first (None: it holds them already)."""
        try:
            self.connection.send((iteration, version, weights, records, max_prompt_tokens))
        except (BrokenPipeError, ConnectionResetError, EOFError):
            raise WorkerDied(self._ended()) from None
        return self._answer()

    def offer(self, version: int, weights: Packed) -> None:
        """The weights after `version` updates, for the worker to load between its batch's turns
        (only the latest offered is sent)."""
        with self.offered:
            self.latest = (version, weights)
            self.offered.notify()

    def _send_pushes(self) -> None:
        while True:
            with self.offered:
                self.offered.wait_for(lambda: self.latest is not None or self.closed)
                if self.closed:
                    return
                latest, self.latest = self.latest, None
            try:
                self.pushes.send(latest)
            except OSError:  # the worker ended
                return

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

    def _join(self, timeout: float) -> int | None:
        """The process's exit code once it has ended within `timeout`, else None. One thread at a time:
        two waiting on one process at once could each miss its end (only one of them reaps it)."""
        with self.reaping:
            self.process.join(timeout=timeout)
            return self.process.exitcode

    def _ended(self) -> str:
        code = self._join(1.0)
        if code is None:
            return f"its process {self.process.pid} stopped answering"
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return f"its process {self.process.pid} {how}"

    def close(self, wait: bool) -> None:
        """End the worker: asked to stop (`wait`: given `END_WAIT_S` to do so), then killed."""
        with self.offered:
            self.closed = True
            self.offered.notify()
        with contextlib.suppress(OSError):
            self.connection.send(None)
        if self._join(END_WAIT_S if wait else 0.0) is None:
            self.process.kill()
            self._join(END_WAIT_S)
        self.connection.close()
        self.pushes.close()


class Pushes:
    """A worker process's end of the weights pushed while its batch is in flight: between turns
    (`StandaloneEngine.between_turns`) and before each batch it loads the newest, if newer than its own."""

    def __init__(self, connection: Connection, policy):
        self.connection, self.policy = connection, policy

    def load_newer(self) -> bool:
        newest = None
        with contextlib.suppress(EOFError, OSError):  # the trainer's end closed: nothing more comes
            while self.connection.poll(0):
                newest = self.connection.recv()
        if newest is None or newest[0] <= self.policy.weights_version:
            return False
        load(self.policy, *newest)
        return True


def load(policy, version: int, weights: Packed) -> None:
    """The pushed weights after `version` updates, into the worker's policy; checked by the sum of
    each of its tensors afterwards (in another order of summation: equal to 1e-9)."""
    policy.model.load_state_dict(unpack(weights))
    loaded = sums(policy.model.state_dict())
    if loaded.shape != weights.sums.shape or not torch.allclose(loaded, weights.sums, rtol=1e-9, atol=1e-9):
        differ = [name for (name, *_), a, b in zip(weights.layout, loaded, weights.sums) if not torch.isclose(a, b, rtol=1e-9, atol=1e-9)]
        raise WeightPushFailed(f"the weights after {version} updates did not land in the worker's policy: its tensors "
                               f"{', '.join(differ[:3]) or '(another set of them)'} differ from the ones pushed; look at how the "
                               f"policy's module takes a state dict (load_state_dict)")
    policy.weights_version = version


def serve(recipe: Recipe, number: int, first: int, device: torch.device, threads: int, connection: Connection,
          pushes: Connection, group: WorkerGroup | None = None) -> None:
    """A worker process's life: build the components, then make each batch asked for until told to stop."""
    from rlkit_core.context import BuildContext
    from rlkit_core.recipe.assemble import build_components
    from rlkit_core.runtime import rollout
    from rlkit_core.runtime.engine import StandaloneEngine

    end_with_parent()
    torch.set_num_threads(threads)
    run = recipe.run
    try:
        launch = group.join() if group is not None else ONE_PROCESS
        index = group.index if group is not None else 0  # a stream of its own for each (worker, trainer process)
        torch.manual_seed(run.seed + SEED_STRIDE * (WORKER_SEEDS + launch.processes * number + index) + first)
        engine = StandaloneEngine(recipe, device, launch)
        context = BuildContext(recipe=recipe, device=device, output_dir=run.output_dir, seed=worker_seed(run.seed, number), launch=launch)
        components = build_components(recipe, context, with_critic=False)  # it samples and scores, never trains
        components.policy.model.requires_grad_(False)
        newer = Pushes(pushes, components.policy)
        if recipe.scheduler.partial_rollouts:
            engine.newer_weights = newer.load_newer
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
                load(components.policy, version, weights)
                del weights  # the shared segments are freed once no process holds them
            newer.load_newer()  # pushed since the request was sent: the newest weights, as `sync` would sample with
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
    if group is not None:  # tearing a gloo group down at exit may abort the process (`Processes.exit_together`)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _request(connection: Connection):
    """The next request, or None: told to stop, or the trainer's end of the pipe closed."""
    try:
        return connection.recv()
    except (EOFError, OSError):
        return None
