"""The train flow — the main job: prepare, then per step rollout -> evaluate -> GRPO update -> commit -> weight
sync.

Everything a step produced is on disk under runs/<run_id>/ (trials/, details/, checkpoints/, metrics.jsonl,
timings.jsonl, tb/) before the next step starts. `train_steps` is the loop body shared with the resume flow.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path

from prefect import flow
from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_table_artifact,
)
from prefect.futures import PrefectFuture

from flows.common import (
    flow_run_name,
    prepare_stage,
    run_events,
    serving_engine,
    start_run,
)
from grpoflow.cluster import ray_session
from grpoflow.config import RunConfig, TrainConfig
from grpoflow.evaluation import (
    base_pass_rates,
    before_after_lines,
    evaluation_lines,
    reward_gain,
    task_rewards,
)
from grpoflow.ledger import ledger_table, rollout_discards, run_ledger, time_ledger, token_ledger
from grpoflow.prepare.prompts import load_prompts
from grpoflow.prepare.stage import PreparedRun
from grpoflow.rollout.step import StepRollout, select_step_prompts
from grpoflow.rollout.workers import rollout_workers
from grpoflow.run.commit import StepCommits, is_full_checkpoint, step_dir
from grpoflow.run.health import health_markdown, task_health, write_run_tasks
from grpoflow.run.info import update_run_info
from grpoflow.run.metrics import (
    MetricsLog,
    evaluation_rows,
    has_row,
    plot_curves,
    read_metrics,
    read_step_records,
    summary_markdown,
    training_rows,
)
from grpoflow.run.paths import RunPaths
from grpoflow.run.resume import run_lock
from grpoflow.run.viewer import write_viewer
from grpoflow.scoring import FailedSteps, drop_stale, select_trainable
from grpoflow.train.probe import SyncProbe
from grpoflow.train.ranks import trainer_ranks
from grpoflow.train.sync import engine_busy_seconds, open_weight_sync, sync_dtype
from grpoflow.train.trainer import TrainerState, load_trainer, overlap_note, share_cores_with_engine
from tasks.rollout import evaluate_policy_task, regrade_trials_task, run_trials_task
from tasks.train import grpo_step_task, probe_task, save_step_task, sync_weights_task


@flow(name="train", flow_run_name=flow_run_name("train"), log_prints=True)
def train_flow(config: RunConfig = RunConfig()) -> dict:
    """GRPO training of the policy on agent trials; returns the last step's metrics and timings."""
    cfg = start_run(config, "train")
    with run_events("train", cfg.run_id, cfg.run_dir):
        run = prepare_stage(cfg, "train")
        update_run_info(run.paths, flow="train")  # resume and rerun take train runs only
        create_link_artifact(key=f"{cfg.run_id}-run-dir", link=run.paths.root.resolve().as_uri(), description="Run dir")
        trainer = load_trainer(run.model.path, cfg.train, seed=cfg.seed)
        with run_lock(run.paths.root):
            return train_steps(cfg, run, trainer, start_step=0)


def train_steps(
    cfg: RunConfig, run: PreparedRun, trainer: TrainerState, start_step: int, weights: Path | None = None
) -> dict:
    """Steps `start_step` .. `train.steps - 1`; `weights` (a step checkpoint) is loaded into the engine first
    when resuming. The policy is evaluated before the steps of `evaluation_versions` and after the last one (its
    own metrics row, `step` = `train.steps`). Returns the last step's record (metrics and timings). The caller
    holds the run's lock."""
    model, paths = run.model, run.paths
    prompts = load_prompts(paths.prompts)
    pool = [p for p in prompts if p.split == "train"]  # what dynamic sampling draws new groups from
    log = MetricsLog(paths.metrics, paths.tb)
    commits = StepCommits(paths, log)
    evals = evaluation_versions(cfg.train)
    failed_steps = FailedSteps(cfg.train.max_failed_steps)
    record: dict = {}
    try:
        limit = cfg.train.max_probe_logprob_gap
        sync_probe = SyncProbe(limit) if limit is not None else None
        with (
            ray_session(cfg.cluster),  # trainer ranks and rollout workers on the run's Ray cluster, if any
            serving_engine(cfg, run) as engine,
            open_weight_sync(cfg, engine.replica_urls, trainer, paths.root / "sync", engine.router) as sync,
            trainer_ranks(trainer, model.path, cfg, weights),
            rollout_workers(cfg.cluster, cfg.rollout.concurrency) as workers,
            ExitStack() as stack,  # what the loop sets up once the rollouts are ready to start
        ):
            if weights is not None:  # the trainer holds the resumed checkpoint's weights
                sync_weights_task(sync, trainer, weights, str(start_step), None)
            lora = sync.client.lora_path  # the adapter the engine serves the policy as, when only it is synced
            probe_task(trainer, sync, cfg, sync_probe)
            earlier = read_metrics(paths.metrics) if start_step > 0 else []
            base = base_pass_rates(earlier[0]) if earlier else {}
            ahead = RolloutAhead(cfg, engine.url, model.path, paths, prompts, pool, lora, start_step, workers)
            pending: tuple[str, Path | None] | None = None  # trainer weights the engine does not serve yet
            engine_busy = engine_busy_seconds(sync)  # the engine's compute seconds so far, per step's row
            cores = stack.enter_context(share_cores_with_engine(cfg, trainer.model, lambda: ahead.generating))
            if cfg.train.max_staleness:
                print(overlap_note(cfg, cores))
            if trainer.dp is not None:
                print(trainer.dp.note)
            if workers is not None:
                print(workers.describe())

            def sync_now(into: dict) -> None:
                """The pending weights into the engine; called only while no rollout runs on it. A step that
                syncs twice (an evaluation, then the end of the last step) records both."""
                nonlocal pending
                assert pending is not None and ahead.idle
                t = time.perf_counter()
                moved = sync_weights_task(sync, trainer, pending[1], pending[0], sync_probe)
                moved["sync/bytes"] += into.get("sync/bytes", 0.0)
                into |= moved
                into["time/sync_s"] = into.get("time/sync_s", 0.0) + time.perf_counter() - t
                ahead.engine_version, pending = int(pending[0]), None

            try:
                for step in range(start_step, cfg.train.steps):
                    t0 = time.perf_counter()
                    record = {}
                    ready = ahead.take(step)  # the rollout started during the previous step, once it is done
                    t_waited = time.perf_counter()
                    if pending is not None and (ready is None or step in evals):
                        sync_now(record)  # an evaluation, or this step's own rollout, needs the latest weights
                    t_eval = time.perf_counter()
                    if step in evals:
                        record |= _evaluate(cfg, step, prompts, engine.url, model.path, paths, lora, workers)
                        base = base or base_pass_rates(record)
                    t_rollout = time.perf_counter()
                    rollout, version_used = ready or ahead.run(step)
                    t_collected = time.perf_counter()
                    if cfg.train.max_staleness and step + 1 < cfg.train.steps:
                        # the next step's rollout overlaps this step's update: on the engine's weights, if fresh enough
                        if pending is not None and step + 1 - ahead.engine_version > cfg.train.max_staleness:
                            sync_now(record)
                        ahead.start(step + 1)
                    samples, stale = rollout.samples, {}
                    if cfg.train.max_staleness:
                        samples, stale = drop_stale(samples, step, version_used, cfg.train.max_staleness)
                    trainable, dropped = select_trainable(samples, cfg.rollout.on_retries_exhausted)
                    discards = rollout_discards(rollout.samples, samples, trainable)
                    failed_steps.record(step, rollout.samples, trainable)
                    t1 = time.perf_counter()
                    train_m = grpo_step_task(trainer, trainable, cfg, step)
                    version = str(step + 1)  # number of GRPO updates in the weights; rollout samples carry it
                    record |= {
                        **{f"rollout/{k}": v for k, v in rollout.metrics.items()},
                        "rollout/dropped_groups": float(dropped),
                        **({"rollout/reward_gain": reward_gain(rollout.samples, base)} if base else {}),
                        **{f"rollout/task/{k}": v for k, v in task_rewards(rollout.samples).items()},
                        **{f"rollout/{k}": v for k, v in stale.items()},
                        **{f"train/{k}": v for k, v in train_m.items()},
                        "weight_version": version,
                        "time/eval_s": t_rollout - t_eval,
                        "time/rollout_s": t_collected - t_rollout + t_waited - t0,
                        "time/rollout_run_s": rollout.seconds,
                        "time/train_s": time.perf_counter() - t1,
                        "time/step_s": time.perf_counter() - t0,
                    }
                    record |= token_ledger(record, discards)
                    t2 = time.perf_counter()
                    commits.flush()  # the previous full checkpoint is durable (it had the whole step to finish)
                    full = is_full_checkpoint(step, cfg.train.steps, cfg.train.save_interval)
                    last = step == cfg.train.steps - 1
                    plan = step_dir(full, last, sync.needs_dir, sync_dtype(cfg.engine))  # None: an in-memory sync's
                    ckpt = save_step_task(trainer, paths, step, record, plan) if plan else None
                    record["time/commit_s"] = time.perf_counter() - t2
                    pending = (version, ckpt)
                    if ahead.idle:  # else at the next step, once the rollout running now is done
                        sync_now(record)
                    busy, engine_busy = engine_busy, engine_busy_seconds(sync)
                    if busy is not None and engine_busy is not None:
                        record["time/engine_busy_s"] = engine_busy - busy
                    record["time/wall_s"] = time.perf_counter() - t0  # the whole step, its syncs and commit included
                    record |= time_ledger(record, cfg.cluster.train_ranks)
                    commits.finish(trainer, ckpt, step, record, full)
                    print(
                        f"step {step + 1}/{cfg.train.steps}: reward {record['rollout/reward_mean']:.3f} "
                        f"pass@k {record['rollout/pass_at_k']:.2f} truncated {record['rollout/truncated_ratio']:.2f} "
                        f"loss {train_m.get('loss', float('nan')):.4f} ({time.perf_counter() - t0:.0f}s)"
                    )
            finally:
                ahead.settle()  # a step failed while the next one's rollout ran: let it finish on the live engine
            final = cfg.train.steps
            if final in evals and not has_row(paths.metrics, final):
                t0 = time.perf_counter()
                evaluation = _evaluate(cfg, final, prompts, engine.url, model.path, paths, lora, workers)
                row = {"weight_version": str(final), **evaluation}
                commits.flush()  # the last step's row comes first
                log.log(final, row | {"time/eval_s": time.perf_counter() - t0})
            commits.flush()
    except BaseException:
        # However the loop ended, the last full checkpoint is completed and its rows logged; if that fails too,
        # the error that ended the loop is the one raised.
        try:
            commits.flush()
        except Exception as err:  # noqa: BLE001  (reported, then the loop's own error propagates)
            print(f"completing the last full checkpoint failed as well: {type(err).__name__}: {err}")
        raise
    finally:
        log.close()
    finish(cfg, paths)
    return record


def finish(cfg: RunConfig, paths: RunPaths) -> None:
    """The end of a train run once its steps and evaluations are recorded: its report, then `ended` in run.json."""
    report(cfg, paths)
    update_run_info(paths, ended=datetime.now(timezone.utc).isoformat(timespec="seconds"))


class RolloutAhead:
    """Step rollouts, run now (`run`) or started in the background to overlap the trainer's step (`start`, one
    at a time, as a Prefect task run of its own), and the weight version the engine serves, which changes only
    while no rollout runs (`idle`): every turn of a trial comes from one version. A rollout is returned with the
    version it ran on."""

    def __init__(
        self, cfg: RunConfig, engine_url, tokenizer_path, paths, prompts, pool, lora, engine_version: int, workers
    ):
        self.cfg, self.engine_url, self.tokenizer_path, self.paths = cfg, engine_url, tokenizer_path, paths
        self.prompts, self.pool, self.lora, self.workers = prompts, pool, lora, workers
        self.engine_version = engine_version
        self._running: tuple[int, int, PrefectFuture] | None = None  # (step, version, future)

    @property
    def idle(self) -> bool:
        return self._running is None

    @property
    def generating(self) -> bool:
        """A rollout started ahead is still running (its trials generating on the engine)."""
        return self._running is not None and not self._running[2].wrapped_future.done()

    def _args(self, step: int) -> tuple:
        step_prompts = select_step_prompts(self.prompts, step, self.cfg.rollout.prompts_per_step)
        return self.cfg, step, step_prompts, self.engine_url, self.tokenizer_path, self.paths

    def run(self, step: int) -> tuple[StepRollout, int]:
        assert self.idle
        kwargs = {"pool": self.pool, "lora_path": self.lora, "workers": self.workers}
        return run_trials_task(*self._args(step), **kwargs), self.engine_version

    def start(self, step: int) -> None:
        assert self.idle
        future = run_trials_task.submit(*self._args(step), pool=self.pool, lora_path=self.lora, workers=self.workers)
        self._running = (step, self.engine_version, future)

    def settle(self) -> None:
        """Wait for a rollout still running: its trials are real and get journaled whole, and the engine they
        talk to must outlive them. Its own error, if any, is left to the log: the caller is already failing."""
        if self._running is not None:
            step, _, future = self._running
            print(f"waiting for step {step}'s rollout, started ahead, to finish before stopping")
            future.wait()
            self._running = None

    def take(self, step: int) -> tuple[StepRollout, int] | None:
        """Step `step`'s rollout if it was started ahead, once it finished (its error raised); else None."""
        if self._running is None or self._running[0] != step:
            return None
        _, version, future = self._running
        self._running = None
        return future.result(), version


def evaluation_versions(train: TrainConfig) -> set[int]:
    """Weight versions (updates so far) the run evaluates: the base policy, every `eval_interval`-th, the last."""
    if train.eval_samples_per_prompt == 0:
        return set()
    every = set(range(0, train.steps, train.eval_interval)) if train.eval_interval else set()
    return {0, train.steps} | every


def _evaluate(
    cfg: RunConfig, version: int, prompts, engine_url: str, tokenizer_path: str, paths, lora: str | None, workers
) -> dict:
    metrics = evaluate_policy_task(cfg, version, prompts, engine_url, tokenizer_path, paths, lora, workers)
    for line in evaluation_lines(metrics, f"after {version} steps" if version else "base policy"):
        print(line)
    return metrics


def report(cfg: RunConfig, paths) -> None:
    run_id = cfg.run_id
    records = read_step_records(paths.metrics)
    if not records:
        return
    ledger = run_ledger(training_rows(records), cfg.report.cost_per_gpu_hour, cfg.report.cost_per_sandbox_hour)
    create_table_artifact(
        key=f"{run_id}-ledger",
        table=ledger_table(ledger),
        description="Where the run's generated tokens went, and what its parts took",
    )
    keys = [
        "step",
        "rollout/reward_mean",
        "rollout/reward_gain",
        "rollout/pass_at_k",
        "rollout/truncated_ratio",
        "rollout/retries",
        "rollout/dropped_groups",
        "train/loss",
        "train/grad_norm",
        "train/n_samples",
        "time/step_s",
    ]
    create_table_artifact(
        key=f"{run_id}-steps",
        table=[{k: r.get(k) for k in keys} for r in training_rows(records)],
        description="Per-step metrics",
    )
    evals = evaluation_rows(records)
    verdict = before_after_lines(evals[0], evals[-1]) if len(evals) > 1 else []
    if verdict:
        print(
            "\n".join(
                [
                    "before -> after training (pass@1, 95 % intervals; the same trials, only the weights differ):",
                    *verdict,
                ]
            )
        )
    if cfg.report.regrade_per_task:
        regrade_trials_task(cfg, paths)
    write_run_tasks(paths.root)
    unreadable: list[str] = []
    create_markdown_artifact(
        key=f"{run_id}-tasks",
        markdown=health_markdown(*task_health(Path(cfg.output_dir), unreadable), unreadable),
        description=f"Task health across the runs in {cfg.output_dir}",
    )
    viewer = write_viewer(paths, run_id)
    create_link_artifact(
        key=f"{run_id}-viewer", link=viewer.resolve().as_uri(), description="Best and worst trial of every group"
    )
    png = plot_curves(records, paths.root / "summary.png")
    create_markdown_artifact(
        key=f"{run_id}-summary",
        markdown=summary_markdown(run_id, paths.root, records, png, verdict, ledger_table(ledger)),
        description="Run summary",
    )
