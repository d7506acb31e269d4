# pyright: standard
"""Rollouts made ahead of the update: `[scheduler] max_staleness` above 0.

Producer threads make the batch of iteration j, the prompt stream's batch j as `sync` would make
it, from a copy of the policy's weights (a generator of their own samples from it: the module being
trained cannot be sampled meanwhile), while the trainer trains on an earlier batch. With a bound
of k there are k workers, each with its copy, making iterations w, w + k, ... so that k batches
can wait on environments or rewards at once. A copy's version is the number of updates its
weights have seen; every batch carries the version that sampled all of it (a copy changes only
between batches). With `scheduler.workers = "processes"` a worker's thread drives a process of its
own, which holds the copy and makes the batch (`rlkit_core.runtime.producer_processes`); the
thread only sends it the records and the pushed weights and waits. The bound is kept twice:

- a worker starts batch j only when j − version ≤ bound, and versions only grow;
- the trainer checks j − version when it takes the batch, and makes a batch that is staler again
  from the current weights (`async/regenerated`), so no trained token is staler than the bound.

The trainer pushes its weights to the workers when it takes the batch of an iteration, before it
waits. At bound 0 the one worker makes each batch after the update before it and before the update
after it, so it samples from the trainer's own module (no copy) and draws the same random numbers
in the same order as `sync`: every metric is the same to the last digit. (A copy in other memory
can round a log-prob differently, by about 1e-8.) The
update's π_old is recomputed with the weights that train (the proximal policy); the loss's
π_old/π_sampler weight (`loss.tis_cap`) corrects for the older weights that sampled.

A batch the trainer waits for longer than `scheduler.wait_timeout_s` ends the run (`Stalled`),
with a checkpoint of the last iteration it trained; so does a worker that could not load the pushed
weights or make its batch (`ProducerFault`; a failed reward is raised as itself, where `sync`
raises it, for `run.on_bad_reward`). Either way the run then waits for no worker (one stuck in a
call never returns, and Python cannot stop a thread: they are daemon threads), so it ends about
`wait_timeout_s` plus the checkpoint's time after its last trained iteration. Any other end waits
for the batches in flight `CLOSE_WAIT_S` at most, all workers together, and not for a worker busy
longer than `wait_timeout_s`. Batches made ahead are not checkpointed: a
resumed run makes them again from its prompt stream, so every prompt trains once, in order.
"""

from __future__ import annotations

import copy
import functools
import threading
import time
from typing import cast

import attrs
import torch

from rlkit_core.batch import RolloutBatch
from rlkit_core.errors import RecipeError, RunError
from rlkit_core.interfaces import Policy
from rlkit_core.recipe.assemble import Components
from rlkit_core.runtime.batch_sources import SamplingView
from rlkit_core.runtime.distributed import SideProcesses
from rlkit_core.runtime.engine import Engine, SamplingEngine
from rlkit_core.runtime.faults import BadReward
from rlkit_core.runtime.producer_processes import Packed, ProcessWorker, pack, worker_groups, worker_seed
from rlkit_core.runtime.push_check import PushCheck

CLOSE_WAIT_S = 5.0  # the longest an ordinary close waits for the batches in flight, all workers together


class ProducerFault(RunError):
    """A batch made ahead did not come: a worker failed (this) or stalled (`Stalled`). The run ends
    with a checkpoint of what it trained."""


class Stalled(ProducerFault):
    """No batch came within `scheduler.wait_timeout_s`."""


@attrs.define
class Made:
    iteration: int
    version: int  # the updates the sampling weights had seen
    batch: RolloutBatch | None = None
    metrics: dict[str, float] = attrs.field(factory=dict)
    error: BaseException | None = None


class WeightsCopy:
    """What the producer's generator samples from, and pushes to an engine of its own: the policy's
    tokenizer and end ids, and a copy of its module (the module being trained cannot be sampled
    meanwhile)."""

    def __init__(self, policy):
        self.policy = policy
        self.model = copy.deepcopy(policy.model)
        self.model.requires_grad_(False)
        for name in ("tokenizer", "eos_token_ids", "suppressed_token_ids", "context_length"):
            setattr(self, name, getattr(policy, name))
        self.weights_version = policy.weights_version  # the producer sets it as it loads pushed weights


class SideEngine(SamplingEngine):
    """What stage 1 reads of the engine (a `RolloutEngine`), for the producer's thread: the device,
    the run's autocast, and the processes over a group of their own (`SideProcesses`). A thread
    worker samples a copy of the weights, whole (under FSDP only workers in processes run ahead)."""

    def __init__(self, engine: Engine):
        self.engine, self.device, self.processes = engine, engine.device, SideProcesses(engine.processes)
        self.push_check = PushCheck(engine.push_check.tolerance)  # the worker's generator, compared on its own

    def autocast(self):
        return self.engine.autocast()


@attrs.define
class Worker:
    """One batch in flight at a time: its own generator, on its own copy of the weights (None: the
    trainer's own, at bound 0), and the version its copy holds."""

    components: Components
    copy: WeightsCopy | None
    # with a process group of the worker's own, its collectives in one order everywhere (None: a worker process, which has its own)
    engine: SideEngine | None
    next: int  # the next iteration it makes: worker w of k makes iterations w, w + k, w + 2k, ... (past the start)
    version: int = -1
    remote: ProcessWorker | None = None  # with `scheduler.workers = "processes"`: the process that makes its batches
    busy_since: float | None = None  # time.monotonic() when it started the batch it is making; None while it waits


class Producer:
    """The batch source that makes batches ahead (`rlkit_core.runtime.batch_sources`): its threads,
    and the trainer's side of them (`take`, `close`), from the run's `SamplingView`. With a
    bound of k, k workers make up to k batches at once (a batch waiting on an environment or a
    reward does not hold up the next); at bound 0 one worker samples from the trainer's module."""

    def __init__(self, view: SamplingView, start: int, bound: int, timeout: float):
        self.view, self.bound, self.timeout = view, bound, timeout
        self.version = start
        self.in_processes = view.recipe.scheduler.workers == "processes"
        self.partial = view.recipe.scheduler.partial_rollouts  # weights loaded between an episode batch's turns too
        # the latest pushed weights (new at each push, never changed): a dict for threads, packed buffers for processes
        self.weights: dict | Packed | None = None
        if self.in_processes:
            self.workers = self._processes(view, start, bound, timeout)
            self.state_names = list(view.components.policy.model.state_dict())  # read here: under FSDP, not inside `full_weights`
            self.weights = self._packed()  # the first batches' weights
        else:
            self.workers = [self._worker(view, number, start + number) if bound else Worker(view.components, None, SideEngine(view.engine), start)
                            for number in range(max(1, bound))]
            if self.partial:
                for worker in self.workers:
                    assert worker.engine is not None  # a thread worker's
                    worker.engine.newer_weights = functools.partial(self._newer_weights, worker)
        self.done: dict[int, Made] = {}
        self.changed = threading.Condition()
        self.stopped = False
        self.given_up = False  # a stall or a worker's failure was raised: the run ends, and `close` waits for no worker
        self.idle = 0.0  # seconds the workers waited for weights
        # Intra-op threads, each thread's own. At bound 0 the worker uses the trainer's count, so its kernels round as the
        # trainer's do. Above it, one: with more, CPU kernels called from a thread other than the main one ran 2-3x slower
        # than with one (benchmarks/README.md). Setting it also sets the default of a thread that has not computed yet,
        # so the trainer sets its own again once the workers have set theirs.
        trainer_threads = torch.get_num_threads()
        self.threads = trainer_threads if not bound else 1
        self.started = threading.Barrier(len(self.workers) + 1)
        self.running = [threading.Thread(target=self._run, args=(worker,), name=f"rlkit-producer-{number}", daemon=True)
                        for number, worker in enumerate(self.workers)]
        for thread in self.running:
            thread.start()
        self.started.wait()
        torch.set_num_threads(trainer_threads)

    @staticmethod
    def _worker(view: SamplingView, number: int, first: int) -> Worker:
        """A generator of its own on a copy of the weights; the copy as the policy too, so that a
        generator with an engine of its own (vLLM) is pushed the copy's weights; and the worker's
        own seed, so that such an engine samples apart from the trainer's and the other workers'."""
        weights = WeightsCopy(view.components.policy)
        context = view.context
        live, seed = context.policy, context.seed
        context.policy, context.seed = cast(Policy, weights), worker_seed(seed, number)  # what a generator reads of a policy, and no more
        try:
            generator = context.build(view.recipe["generator"])
        finally:
            context.policy, context.seed = live, seed
        return Worker(attrs.evolve(view.components, generator=generator, policy=weights), weights, SideEngine(view.engine), first)

    @staticmethod
    def _processes(view: SamplingView, start: int, bound: int, timeout: float) -> list[Worker]:
        """Workers in processes of their own (`rlkit_core.runtime.producer_processes`), all started, then all waited for
        (under several trainer processes, worker w of each in a process group of theirs)."""
        groups = worker_groups(view.engine.processes, bound)
        workers = [Worker(view.components, None, None, start + number,
                          remote=ProcessWorker(view.recipe, number, start, view.engine.device, threads=1, group=group))
                   for number, group in zip(range(bound), groups)]
        for worker in workers:
            assert worker.remote is not None
            try:
                worker.remote.wait_ready(timeout)
            except BaseException as exc:
                for each in workers:
                    assert each.remote is not None
                    each.remote.close(wait=False)
                raise ProducerFault(f"the producer's worker {worker.remote.number} could not start: {exc}") from exc
        return workers

    def push(self, version: int) -> None:
        """The trainer's weights after `version` updates, for the batches the workers start next
        (at bound 0 the worker samples from the trainer's own module, which never trains meanwhile)."""
        state = None
        if self.in_processes:
            state = self._packed()
        elif self.bound:
            state = {name: tensor.detach().clone() for name, tensor in self.view.components.policy.model.state_dict().items()}
        with self.changed:
            self.weights, self.version = state, version
            self.changed.notify_all()
        if self.partial and self.in_processes:  # for the batches in flight, between their turns
            for worker in self.workers:
                assert worker.remote is not None and isinstance(state, Packed)
                worker.remote.offer(version, state)

    def _packed(self) -> Packed:
        """The trainer's weights, whole, in shared buffers for the worker processes. Under FSDP they
        are gathered once for it (every trainer process calls this, in the same order) and read as
        the module's tensors: its `state_dict` would hand back its shards."""
        model = self.view.components.policy.model
        with self.view.engine.full_weights():
            tensors = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
            return pack({name: tensors[name] for name in self.state_names})

    def _newer_weights(self, worker: Worker) -> bool:
        """Between the turns of a thread worker's batch: the weights pushed since it loaded its own,
        loaded into its copy (`scheduler.partial_rollouts`); whether there were any."""
        with self.changed:
            weights, version = self.weights, self.version
        if worker.copy is None or not isinstance(weights, dict) or version <= worker.version:
            return False
        worker.copy.model.load_state_dict(weights)
        worker.version = worker.copy.weights_version = version
        return True

    def take(self, iteration: int) -> tuple[RolloutBatch, dict[str, float]]:
        """The batch of `iteration` and its metrics, no staler than the bound (see the module)."""
        self.push(iteration)
        started = time.perf_counter()
        with self.changed:
            if not self.changed.wait_for(lambda: iteration in self.done, timeout=self.timeout):
                self.given_up = True
                raise Stalled(f"no rollout batch for iteration {iteration + 1} within scheduler.wait_timeout_s = {self.timeout:g} s: "
                              "the generator, the environment or the reward stalled")
            made = self.done.pop(iteration)
            idle, self.idle = self.idle, 0.0
        waited = time.perf_counter() - started
        if made.error is not None:
            if isinstance(made.error, ProducerFault):  # not a failed reward (`BadReward`): the recipe may skip it and go on
                self.given_up = True
            raise made.error
        staleness, regenerated = iteration - made.version, 0
        assert made.batch is not None  # made, since it carries no error
        batch, metrics = made.batch, made.metrics
        if staleness > self.bound:  # cannot happen while versions only grow; kept so the bound is a guarantee
            batch, metrics = self.view.rollout(iteration)
            staleness, regenerated = 0, 1
        metrics = {**metrics, "async/staleness": float(staleness), "async/regenerated": float(regenerated),
                   "time/trainer_waiting": waited, "time/generator_idle": idle}
        if batch.sampled_versions is not None and (sampled := batch.sampled_versions[batch.sampled_versions >= 0]).numel():
            metrics["async/token_staleness"] = float(iteration - sampled.double().mean())  # below async/staleness after a load mid-batch
        return batch, metrics

    def close(self) -> None:
        """Stop the workers, waiting little: a batch in flight is made again on resume. After a stall or a worker's
        failure, for none (one stuck in a call never returns, and the run is ending); else until one deadline
        `CLOSE_WAIT_S` away for all of them, and for none past `wait_timeout_s` on its batch (stuck), so that a
        worker still using the run's reward or environment is given the time to finish before the run goes on."""
        with self.changed:
            self.stopped = True
            self.changed.notify_all()
            given_up = self.given_up
            deadline = time.monotonic() + CLOSE_WAIT_S
            until = [deadline if worker.busy_since is None else min(deadline, worker.busy_since + self.timeout) for worker in self.workers]
        if not given_up:
            for thread, end in zip(self.running, until):
                thread.join(timeout=max(0.0, end - time.monotonic()))
        for worker in self.workers:  # a worker process is ended whatever it is doing: a batch in flight is made again on resume
            if worker.remote is not None:
                worker.remote.close(wait=not given_up)

    def _run(self, worker: Worker) -> None:
        torch.set_num_threads(self.threads)
        self.started.wait()
        while True:
            with self.changed:
                began = time.perf_counter()
                while not self.stopped and worker.next - self.version > self.bound:
                    self.changed.wait()
                self.idle += time.perf_counter() - began
                if self.stopped:
                    return
                weights, version = self.weights, self.version
                iteration, worker.next = worker.next, worker.next + len(self.workers)
                worker.busy_since = time.monotonic()
            made = Made(iteration, version)
            doing = "loading the pushed weights into its copy"
            try:
                if worker.remote is not None:  # loaded and made in the worker's process
                    doing = "making the batch in its process"
                    assert isinstance(weights, Packed)  # with workers in processes, every push is packed
                    made.batch, made.metrics = worker.remote.rollout(iteration, version, weights if worker.version != version else None,
                                                                     self.view.records(iteration), self.view.max_prompt_tokens)
                    worker.version = version
                else:
                    if worker.copy is not None and weights is not None and worker.version != version:
                        worker.copy.model.load_state_dict(weights)
                        worker.version = worker.copy.weights_version = version
                    doing = "making the batch (generation, environment or reward)"
                    assert worker.engine is not None  # a thread worker's
                    with torch.no_grad():
                        made.batch, made.metrics = self.view.rollout(iteration, worker.components, worker.engine)
            except (BadReward, RecipeError) as exc:  # raised where `sync` raises it: a skip or stop, or bad input (exit 2)
                made.error = exc
            except BaseException as exc:  # handed to the trainer, located; it ends the run with a checkpoint
                made.error = ProducerFault(f"the producer's worker {self.workers.index(worker)} failed on the batch of iteration "
                                           f"{iteration + 1} (weights after {version} updates) while {doing}: "
                                           f"{type(exc).__name__}: {exc}")
                made.error.__cause__ = exc
            with self.changed:  # a failed batch too
                self.done[iteration] = made
                worker.busy_since = None
                self.changed.notify_all()
