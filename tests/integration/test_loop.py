"""The training loop without Prefect: `grpoflow.run.loop.train_steps` with the core functions as its stages
(`CORE_STAGES`), on the fence policy and its test tasks. It calls its stages in the order a run needs, overlaps
the next rollout with the update when asked, and writes the run dir a flow's run writes."""

import shutil
import threading
import time

import pytest

from grpoflow.config import parse_run_config
from grpoflow.run.loop import CORE_STAGES, Stages, train_steps
from grpoflow.run.metrics import read_metrics
from grpoflow.run.start import prepare_run
from grpoflow.train.trainer import load_trainer
from tests.integration.faults.policy import fence_policy, reward_tasks, run_config

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")


class Recorder:
    """CORE_STAGES, each call recorded as (stage, its step or version, start, end) in call order."""

    def __init__(self):
        self.calls: list[tuple[str, str, float, float]] = []
        self._lock = threading.Lock()
        self.started: dict[str, threading.Event] = {}
        self.seen_beside: dict[int, bool] = {}

    def _event(self, call: str) -> threading.Event:
        with self._lock:
            return self.started.setdefault(call, threading.Event())

    def update_waiting_for_the_next_rollout(self, fn, steps: int):
        """The update of step s < steps-1 returns only once step s+1's rollout has begun (or 30 s passed): an
        update too quick to overlap (a step with nothing to train on) still shows whether that rollout runs
        beside it."""

        def call(*args, **kwargs):
            step = args[3]
            if step + 1 < steps:
                self.seen_beside[step] = self._event(f"rollout {step + 1}").wait(timeout=30)
            return fn(*args, **kwargs)

        return call

    def wrap(self, name, fn, key):
        def call(*args, **kwargs):
            t0 = time.monotonic()
            self._event(f"{name} {key(args)}".strip()).set()
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.calls.append((name, str(key(args)), t0, time.monotonic()))

        return call

    def stages(self, overlapped_steps: int = 0) -> Stages:
        c = CORE_STAGES
        update = self.update_waiting_for_the_next_rollout(c.update, overlapped_steps) if overlapped_steps else c.update
        return Stages(
            rollout=self.wrap("rollout", c.rollout, lambda a: a[1]),
            evaluate=self.wrap("evaluate", c.evaluate, lambda a: a[1]),
            update=self.wrap("update", update, lambda a: a[3]),
            save=self.wrap("save", c.save, lambda a: a[2]),
            sync=self.wrap("sync", c.sync, lambda a: a[3]),
            probe=self.wrap("probe", c.probe, lambda a: ""),
            check_engine=self.wrap("check_engine", c.check_engine, lambda a: ""),
        )

    def order(self) -> list[str]:
        return [f"{name} {key}".strip() for name, key, _, _ in sorted(self.calls, key=lambda c: c[2])]


@pytest.mark.parametrize("k", [0, 1])
def test_the_loop_runs_its_stages_in_order_without_prefect(tmp_path, tiny_model_dir, k):
    model = fence_policy(tiny_model_dir, tmp_path / "policy")
    data = reward_tasks(tmp_path / "tasks")
    raw = run_config(tmp_path / "runs", model, data, f"loop-{k}", steps=3, evals=1)
    raw["train"] |= {"max_staleness": k}
    cfg = parse_run_config(raw)
    run = prepare_run(cfg)
    recorder = Recorder()
    record = train_steps(
        cfg,
        run,
        load_trainer(run.model.path, cfg.train, seed=cfg.seed),
        0,
        recorder.stages(overlapped_steps=3 if k else 0),
    )
    *rows, final = read_metrics(run.paths.metrics)
    assert [r["step"] for r in rows] == [0, 1, 2] and final["step"] == 3 and record["weight_version"] == "3"
    order = recorder.order()
    assert order[:3] == ["check_engine", "probe", "evaluate 0"]
    assert order[-1] == "evaluate 3"
    for step in range(3):  # each step's update comes after its rollout
        assert order.index(f"rollout {step}") < order.index(f"update {step}")
    # the weights reach the embedded engine in memory: only full checkpoints (save_interval 2, the last) are saved
    assert [c for c in order if c.startswith("save")] == ["save 1", "save 2"]
    assert order.index("update 2") < order.index("save 2") < order.index("sync 3") < order.index("evaluate 3")
    if k == 0:  # every update reaches the engine before the next rollout
        for step in range(2):
            assert order.index(f"update {step}") < order.index(f"sync {step + 1}") < order.index(f"rollout {step + 1}")
    else:  # the next rollout begins while the update runs, on the weights the engine had
        assert recorder.seen_beside == {0: True, 1: True}
