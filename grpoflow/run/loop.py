"""The training loop, without Prefect: per step, rollout (now, or started during the previous step) -> filter
-> GRPO update -> commit -> weight sync, with the policy evaluated before the first step, every
`train.eval.interval` steps and after the last.

    for step in range(start_step, cfg.train.steps):
        loop.step(step)

The stages are handed in (`Stages`): the Prefect flow hands its tasks, so each call is a task run of its own; a
plain caller hands the core functions (`CORE_STAGES`). Everything a step produced is on disk under
runs/<run_id>/ (trials/, details/, checkpoints/, metrics.jsonl, timings.jsonl, tb/) before the next step
starts, except, with `train.max_staleness` > 0, the next step's rollout, which runs in a thread beside the update
(one at a time, a plain future): the weights reach the engine only while no rollout runs on it, so every turn of
a trial comes from one weight version.

An engine the run started that exits is restarted in place (`grpoflow.engine.restart`) and given the weights it
served before its generation resumes (`StepLoop._restore`); the trials waiting for it go on.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpoflow.cluster import ray_session, serve_host
from grpoflow.config import AttachedEngine, RunConfig, StartedEngine, TrainConfig
from grpoflow.engine.backends import EngineHandle, open_engine
from grpoflow.engine.restart import EngineKeeper
from grpoflow.errors import EngineError
from grpoflow.figures import Figures
from grpoflow.ledger import rollout_discards, time_ledger, token_ledger
from grpoflow.placement import machine_gpus, plan_gpus
from grpoflow.preflight import engine_preflight
from grpoflow.prepare.prompts import PromptRecord, load_prompts
from grpoflow.rollout.step import RolloutSetup, StepRollout, run_step_trials, select_step_prompts
from grpoflow.rollout.workers import rollout_workers
from grpoflow.run.commit import StepCommits, is_full_checkpoint, save_step, step_dir
from grpoflow.run.info import add_engine_restart, update_run_info
from grpoflow.run.metrics import MetricsLog, append_step, has_row, read_metrics
from grpoflow.run.record import StepRecord
from grpoflow.run.start import PreparedRun
from grpoflow.samples import select_trainable
from grpoflow.scoring.evaluation import base_pass_rates, evaluate_policy, evaluation_lines, reward_gain, task_rewards
from grpoflow.scoring.groups import FailedSteps, drop_foreign, drop_stale
from grpoflow.train.probe import SyncProbe
from grpoflow.train.ranks import run_update, trainer_ranks
from grpoflow.train.sync import ReplicaSyncs, open_weight_sync, probe_engines, sync_dtype, sync_weights
from grpoflow.train.threads import share_cores
from grpoflow.train.trainer import TrainerState


@dataclass(frozen=True)
class Stages:
    """The loop's calls, each with the signature of the core function it stands for."""

    rollout: Callable[..., StepRollout]  # run_step_trials(cfg, step, prompts, setup, paths, pool)
    evaluate: Callable[..., dict[str, float]]  # evaluate_policy(cfg, version, prompts, setup, paths, base)
    update: Callable[..., Figures]  # run_update(trainer, samples, cfg, step)
    save: Callable[..., Path]  # save_step(trainer, paths, step, record, plan)
    sync: Callable[..., dict[str, float]]  # sync_weights(syncs, trainer, ckpt, version, probe)
    probe: Callable[..., dict[str, float]]  # probe_engines(trainer, syncs, cfg, sync_probe)
    check_engine: Callable[[str, str], None]  # engine_preflight(url, model_path), for an engine the run started


CORE_STAGES = Stages(
    rollout=run_step_trials,
    evaluate=evaluate_policy,
    update=run_update,
    save=save_step,
    sync=sync_weights,
    probe=probe_engines,
    check_engine=engine_preflight,
)


def evaluation_versions(train: TrainConfig) -> set[int]:
    """Weight versions (updates so far) the run evaluates: the base policy, every `train.eval.interval`-th, the last."""
    if train.eval.samples_per_prompt == 0:
        return set()
    every = set(range(0, train.steps, train.eval.interval)) if train.eval.interval else set()
    return {0, train.steps} | every


@contextmanager
def serving(cfg: RunConfig, run: PreparedRun, stages: Stages) -> Iterator[EngineHandle]:
    """The run's Ray session (its trainer ranks and rollout workers run there, if it has one) and its engine, for
    the block; an engine the run started is checked to serve the prepared model."""
    gpus = plan_gpus(cfg, machine_gpus())
    update_run_info(run.paths, gpus=gpus.to_json())
    with (
        ray_session(cfg.cluster),
        open_engine(
            cfg.engine, run.model.path, cfg.seed, run.paths.engine_log, gpus.engine_base_gpu, serve_host(cfg.cluster)
        ) as engine,
    ):
        if not isinstance(cfg.engine, AttachedEngine):
            for url in engine.replica_urls:
                stages.check_engine(url, run.model.path)
        yield engine


def evaluate_run(
    cfg: RunConfig, run: PreparedRun, prompts: list[PromptRecord], version: int, base: Path | None, stages: Stages
) -> dict[str, float]:
    """An evaluation of the engine's weights outside a train run (the nightly one): the train run's evaluation
    trials (`evaluate_policy`) on `prompts`, as weight version `version`, compared with the evaluation whose
    details dir is `base` (the train run's first one: the same trials, on the base policy). Its row goes to
    metrics.jsonl as step `version`."""
    with (
        serving(cfg, run, stages) as engine,
        rollout_workers(cfg.cluster, cfg.rollout.concurrency, (engine.url,)) as workers,
    ):
        setup = RolloutSetup(engine.url, run.model.path, None, workers)
        metrics = stages.evaluate(cfg, version, prompts, setup, run.paths, base)
    append_step(run.paths.metrics, version, {"weight_version": str(version), **metrics}, {})
    return metrics


def train_steps(
    cfg: RunConfig,
    run: PreparedRun,
    trainer: TrainerState,
    start_step: int = 0,
    stages: Stages = CORE_STAGES,
    weights: Path | None = None,
) -> dict[str, Any]:
    """Steps `start_step` .. `train.steps - 1`, then the final evaluation; `weights` (a step checkpoint) is loaded
    into the engine first when resuming. Returns the last step's metrics and timings. The caller holds the run's
    lock."""
    record: StepRecord | None = None
    with StepLoop(cfg, run, trainer, stages, start_step, weights) as loop:
        for step in range(start_step, cfg.train.steps):
            record = loop.step(step)
        loop.evaluate_last()
    return record.metrics() | record.timings() if record is not None else {}


class RolloutAhead:
    """Step rollouts, run now (`run`) or started in a thread to overlap the trainer's step (`start`, one at a
    time), and the weight version the engine serves, which changes only while no rollout runs (`idle`)."""

    def __init__(self, run_rollout: Callable[[int], StepRollout], engine_version: int):
        self._run, self.engine_version = run_rollout, engine_version
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead")
        self._running: tuple[int, Future[StepRollout]] | None = None  # (step, future)

    @property
    def idle(self) -> bool:
        return self._running is None

    @property
    def generating(self) -> bool:
        """A rollout started ahead is still running (its trials generating on the engine)."""
        return self._running is not None and not self._running[1].done()

    def run(self, step: int) -> StepRollout:
        assert self.idle
        return self._run(step)

    def start(self, step: int) -> None:
        assert self.idle
        # in a copy of this thread's context: a caller's context (the Prefect flow run) holds in the thread too
        future = self._pool.submit(contextvars.copy_context().run, self._run, step)
        self._running = (step, future)

    def take(self, step: int) -> StepRollout | None:
        """Step `step`'s rollout if it was started ahead, once it finished (its error raised); else None."""
        if self._running is None or self._running[0] != step:
            return None
        _, future = self._running
        self._running = None
        return future.result()

    def settle(self) -> None:
        """Wait for a rollout still running: its trials are real and get journaled whole, and the engine they
        talk to must outlive them. Its own error, if any, is left to its log: the caller is already failing."""
        if self._running is not None:
            step, future = self._running
            print(f"waiting for step {step}'s rollout, started ahead, to finish before stopping")
            future.exception()
            self._running = None
        self._pool.shutdown()


class StepLoop:
    """One run's steps, with what they hold open: the Ray session, the engine, the weight sync, the trainer
    ranks, the rollout workers, the metrics log and the commits of full checkpoints in the background."""

    def __init__(
        self,
        cfg: RunConfig,
        run: PreparedRun,
        trainer: TrainerState,
        stages: Stages,
        start_step: int,
        weights: Path | None,
    ):
        self.cfg, self.run, self.trainer, self.stages = cfg, run, trainer, stages
        self.start_step, self.weights = start_step, weights
        self.paths = run.paths
        self.prompts = load_prompts(self.paths.prompts)
        self.pool = [p for p in self.prompts if p.split == "train"]  # what dynamic sampling draws new groups from
        self.evals = evaluation_versions(cfg.train)
        self.failed_steps = FailedSteps(cfg.train.max_failed_steps)
        limit = cfg.train.max_probe_logprob_gap
        self.sync_probe = SyncProbe(limit) if limit is not None else None
        self.pending: tuple[str, Path | None] | None = None  # trainer weights the engine does not serve yet
        # What the engines serve: (weight version, the dir it was loaded from; None in memory), and the updates
        # in the trainer's weights. Both change under `_weights`, which an engine's restore takes too.
        self.served: tuple[str, Path | None] = (
            (str(start_step), weights) if weights is not None else ("0", Path(run.model.path))
        )
        self.trainer_version = start_step
        self._weights = threading.Lock()
        self.keeper: EngineKeeper | None = None
        self._stack = ExitStack()
        self._failing = True  # until the loop ends well: then a failing commit is the error to raise

    def __enter__(self) -> StepLoop:
        cfg, stack = self.cfg, self._stack
        try:
            self.log = MetricsLog(self.paths.metrics, self.paths.tb)
            stack.callback(self.log.close)
            self.commits = StepCommits(self.paths, self.log, served=lambda: self.served[1])
            stack.callback(self._complete_commits)
            self.engine = stack.enter_context(serving(cfg, self.run, self.stages))
            self.syncs: ReplicaSyncs = stack.enter_context(
                open_weight_sync(cfg, self.engine.replica_urls, self.trainer, self.paths.sync, self.engine.router)
            )
            stack.enter_context(trainer_ranks(self.trainer, self.run.model.path, cfg, self.weights))
            workers = stack.enter_context(rollout_workers(cfg.cluster, cfg.rollout.concurrency, (self.engine.url,)))
            self._start(workers)
            if isinstance(cfg.engine, StartedEngine) and self.engine.processes:
                self.keeper = stack.enter_context(
                    EngineKeeper(
                        self.engine.processes,
                        self._restore,
                        lock=self._weights,
                        max_restarts=cfg.engine.max_restarts,
                        startup_timeout_s=cfg.engine.startup_timeout_s,
                        check=self._check_restored,
                        on_restart=lambda r: add_engine_restart(self.paths, r),
                    )
                )
        except BaseException as err:
            if not stack.__exit__(type(err), err, err.__traceback__):
                raise
        return self

    def _start(self, workers) -> None:
        """Before the first step: the resumed weights into the engine, the probes, the rollout schedule."""
        cfg, trainer = self.cfg, self.trainer
        if self.weights is not None:  # the trainer holds the resumed checkpoint's weights
            self.stages.sync(self.syncs, trainer, self.weights, str(self.start_step), None)
        elif isinstance(cfg.engine, AttachedEngine):  # it may serve an earlier run's weights; the run's own now
            self.stages.sync(self.syncs, trainer, Path(self.run.model.path), "0", None)
        else:  # started on the prepared model: labelled with the version its samples record
            self.syncs.label("0")
        gap = self.stages.probe(trainer, self.syncs, cfg, self.sync_probe)
        if gap:
            print(
                f"engine vs trainer on a {gap['tokens']:.0f}-token probe: mean |logprob gap| {gap['mean']:.2e}, "
                f"max {gap['max']:.2e}"
            )
        earlier = read_metrics(self.paths.metrics) if self.start_step > 0 else []
        self.base = base_pass_rates(earlier[0]) if earlier else {}
        # the adapter the engine serves the policy as, when only it is synced
        self.setup = RolloutSetup(self.engine.url, self.run.model.path, self.syncs.client.lora_path, workers)
        self.ahead = RolloutAhead(self._rollout, self.start_step)
        self._stack.callback(self.ahead.settle)  # a step failed while the next one's rollout ran: let it finish
        self.engine_busy = self.syncs.busy_seconds()  # the engine's compute seconds so far, per step's row
        if cfg.train.max_staleness:
            note = f"max_staleness {cfg.train.max_staleness}: each step's rollout runs while the previous step trains"
            if self.engine.host_threads and trainer.device.type == "cpu":
                cores = self._stack.enter_context(
                    share_cores(trainer.model, self.engine.host_threads, lambda: self.ahead.generating)
                )
                note += f"; the trainer's torch threads: {cores.beside} while a rollout runs beside it, "
                note += f"{cores.alone} otherwise"
            print(note)
        if trainer.dp is not None:
            print(trainer.dp.note)
        if workers is not None:
            print(workers.describe())

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._failing = exc_type is not None
        return self._stack.__exit__(exc_type, exc, tb)  # each context the loop holds sees how the loop ended

    def _complete_commits(self) -> None:
        """However the loop ended, the last full checkpoint is completed and its rows logged; if that fails after
        the loop failed, the loop's error is the one raised."""
        try:
            self.commits.flush()
        except Exception as err:
            if not self._failing:
                raise
            print(f"completing the last full checkpoint failed as well: {type(err).__name__}: {err}")

    def _rollout(self, step: int) -> StepRollout:
        prompts = select_step_prompts(self.prompts, step, self.cfg.rollout.prompts_per_step)
        return self.stages.rollout(self.cfg, step, prompts, self.setup, self.paths, self.pool)

    def _evaluate(self, version: int) -> dict[str, float]:
        metrics = self.stages.evaluate(self.cfg, version, self.prompts, self.setup, self.paths)
        for line in evaluation_lines(metrics, f"after {version} steps" if version else "base policy"):
            print(line)
        return metrics

    def sync_now(self, record: StepRecord) -> None:
        """The pending weights into the engine; only while no rollout runs on it. A step that syncs twice (an
        evaluation, then the end of the last step) records both. An engine that exited during the sync is
        restarted and the sync made once more."""
        assert self.pending is not None and self.ahead.idle
        t = time.perf_counter()
        version, ckpt = self.pending
        for again in (False, True):
            if self.keeper is not None:
                self.keeper.settle()  # an engine that exited is back, on its weights
            brought_back = self.keeper.brought_back if self.keeper is not None else 0
            try:
                with self._weights:
                    moved = self.stages.sync(self.syncs, self.trainer, ckpt, version, self.sync_probe)
                    self.served = (version, ckpt)
                break
            except (EngineError, RuntimeError):  # a dead engine's socket closing fails our side of a broadcast
                if again or self.keeper is None:
                    raise
                self.keeper.settle(grace_s=10.0)  # an engine going down has that long to exit, and is restarted
                if self.keeper.brought_back == brought_back:  # no engine came back meanwhile: a fault of its own
                    raise
        record.add_sync(moved, time.perf_counter() - t)
        self.ahead.engine_version, self.pending = int(version), None

    def _restore(self, i: int) -> str:
        """Engine `i` (as `engine.replica_urls`), restarted on the prepared model with its generation held: the
        weights it served, through a new sync to it. Returns their version; EngineError when they are not at hand
        (a rollout generates on an older version than the trainer's, and the sync is in memory). The keeper holds
        `_weights` around it."""
        version, where = self.served
        trainer = str(self.trainer_version)
        if not self.syncs.needs_dir and trainer != version and self.ahead.generating:
            raise EngineError(
                f"weight version {version}, which a rollout generates on, is not at hand: the trainer holds "
                f"version {trainer} and the weight sync is in memory"
            )
        sync = self.syncs.reopen(i)
        if self.syncs.needs_dir:  # the dir the version served was loaded from
            sync.push(self.trainer, version, where)
        else:
            # no rollout runs on the version served, or the trainer holds it: the trainer's weights, whose sync to
            # every engine is pending if they are newer
            version = trainer
            sync.push(self.trainer, version)
        self.syncs.readmit(i)
        return version

    def _check_restored(self, i: int) -> None:
        """A restored engine generates as the trainer scores, when the run probes its syncs (`SyncProbe`)."""
        with self._weights:
            client = self.syncs.client_of(i)
            version = client.model_info().weight_version
            if self.sync_probe is not None and version == str(self.trainer_version):
                self.sync_probe.check(client, self.trainer, version)

    def step(self, step: int) -> StepRecord:
        """Step `step`: its rollout, the update on what it may train on, the commit and the sync."""
        cfg, t0 = self.cfg, time.perf_counter()
        record = StepRecord(step)
        ready = self.ahead.take(step)  # the rollout started during the previous step, once it is done
        t_waited = time.perf_counter()
        if self.pending is not None and (ready is None or step in self.evals):
            self.sync_now(record)  # an evaluation, or this step's own rollout, needs the latest weights
        t_eval = time.perf_counter()
        if step in self.evals:
            record.evaluation = self._evaluate(step)
            self.base = self.base or base_pass_rates(record.evaluation)
        t_rollout = time.perf_counter()
        rollout = ready or self.ahead.run(step)
        t_collected = time.perf_counter()
        if cfg.train.max_staleness and step + 1 < cfg.train.steps:
            # the next step's rollout overlaps this step's update: on the engine's weights, if fresh enough
            if self.pending is not None and step + 1 - self.ahead.engine_version > cfg.train.max_staleness:
                self.sync_now(record)
            self.ahead.start(step + 1)
        trainable, filtered, discards = self._filter(step, rollout)
        t1 = time.perf_counter()
        if not trainable:
            print(f"step {step}: no trainable samples (all groups dropped): weights unchanged")
        with self._weights:
            train = self.stages.update(self.trainer, trainable, cfg, step).prefixed("train/")
            self.trainer_version = step + 1
        record.rollout = self._rollout_figures(rollout, filtered)
        record.tokens, train.computed = token_ledger(record.rollout.computed, train.computed, discards)
        record.train = train
        times = record.times
        times.eval, times.rollout = t_rollout - t_eval, t_collected - t_rollout + t_waited - t0
        times.rollout_run, times.train = rollout.seconds, time.perf_counter() - t1
        times.step = time.perf_counter() - t0
        self._commit(record, t0)
        done = record.rollout.computed
        print(
            f"step {step + 1}/{cfg.train.steps}: reward {done['rollout/reward_mean']:.3f} "
            f"pass@k {done['rollout/pass_at_k']:.2f} truncated {done['rollout/truncated_ratio']:.2f} "
            f"loss {train.computed.get('train/loss', float('nan')):.4f} ({time.perf_counter() - t0:.0f}s)"
        )
        return record

    def _filter(self, step: int, rollout: StepRollout):
        """The samples step `step` trains on: within the staleness bound, then without failed groups; the metrics
        of what was left out, and the token discards for the ledger."""
        if self.cfg.train.max_staleness:
            samples, stale = drop_stale(rollout.samples, step, self.cfg.train.max_staleness)
        else:
            samples, stale = drop_foreign(rollout.samples, step)
        trainable, dropped = select_trainable(samples, self.cfg.rollout.sandbox.on_retries_exhausted)
        self.failed_steps.record(step, rollout.samples, trainable)
        filtered = {"rollout/dropped_groups": float(dropped), **{f"rollout/{k}": v for k, v in stale.items()}}
        return trainable, filtered, rollout_discards(rollout.samples, samples, trainable)

    def _rollout_figures(self, rollout: StepRollout, filtered: dict[str, float]) -> Figures:
        """The step's `rollout/...` figures: its trials', then what the filter left out."""
        stale = {k: v for k, v in filtered.items() if k != "rollout/dropped_groups"}
        figures = rollout.figures.prefixed("rollout/")
        figures.computed |= {
            "rollout/dropped_groups": filtered["rollout/dropped_groups"],
            **({"rollout/reward_gain": reward_gain(rollout.samples, self.base)} if self.base else {}),
            **{f"rollout/task/{k}": v for k, v in task_rewards(rollout.samples).items()},
            **stale,
        }
        return figures

    def _commit(self, record: StepRecord, t0: float) -> None:
        """The step's checkpoint dir (as the plan says), the sync when no rollout runs, then its rows."""
        cfg, step, times = self.cfg, record.step, record.times
        t2 = time.perf_counter()
        self.commits.flush()  # the previous full checkpoint is durable (it had the whole step to finish)
        full = is_full_checkpoint(step, cfg.train.steps, cfg.train.checkpoint.interval)
        last = step == cfg.train.steps - 1
        plan = step_dir(full, last, self.syncs.needs_dir, sync_dtype(cfg.engine))  # None: an in-memory sync's
        with self._weights:  # a sharded trainer's ranks take one job at a time: not a restore's gather beside it
            ckpt = self.stages.save(self.trainer, self.paths, step, record, plan) if plan else None
        times.commit = time.perf_counter() - t2
        self.pending = (record.weight_version, ckpt)
        if self.ahead.idle:  # else at the next step, once the rollout running now is done
            self.sync_now(record)
        busy, self.engine_busy = self.engine_busy, self.syncs.busy_seconds()
        if busy is not None and self.engine_busy is not None:
            times.engine_busy = self.engine_busy - busy
        times.wall = time.perf_counter() - t0
        trainer_s = times.train + times.commit + (times.sync or 0.0)
        record.ledger_seconds = time_ledger(
            trainer_s, record.rollout.seconds, times.engine_busy, cfg.cluster.train_ranks
        )
        with self._weights:
            self.commits.finish(self.trainer, ckpt, step, record, full)

    def evaluate_last(self) -> None:
        """The evaluation after the last step, its own metrics row (`step` = `train.steps`), unless a resumed run
        recorded it already."""
        final = self.cfg.train.steps
        if final in self.evals and not has_row(self.paths.metrics, final):
            t0 = time.perf_counter()
            row = {"weight_version": str(final), **self._evaluate(final)}
            self.commits.flush()  # the last step's row comes first
            self.log.log(final, row, {"time/eval_s": time.perf_counter() - t0})
