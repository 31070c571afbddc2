"""Engines restarted in place (`EngineKeeper`), on the real embedded engine: a killed engine comes back on its port
with generation held until the run gave it its weights, and a request waiting out the outage gets its answer; a
replica behind the real sglang-router is back in its rotation."""

from __future__ import annotations

import os
import signal
import threading
import time

from grpoflow.config import TrainConfig, parse_run_config
from grpoflow.engine.backends import open_engine
from grpoflow.engine.client import SglangClient
from grpoflow.engine.launch import start_embedded_engine
from grpoflow.engine.protocol import SamplingParams
from grpoflow.engine.restart import EngineKeeper, Restart
from grpoflow.engine.router import healthy_workers
from grpoflow.errors import EngineError
from grpoflow.train.sync import open_weight_sync
from grpoflow.train.trainer import load_trainer

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
PROMPT = [1, 2, 3, 4]


def _wait_until(what, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_killed_engine_comes_back_on_its_port_and_generates_only_once_restored(tiny_model_dir, tmp_path):
    log = tmp_path / "engine.log"
    with start_embedded_engine(tiny_model_dir, seed=3, max_batch_size=1, log_path=log) as engine:
        before = engine.client.generate(PROMPT, GREEDY).output_ids
        engine.client.update_weight_version("4")
        first_pid = engine.pid
        told: list[Restart] = []
        seen: dict[str, object] = {}
        # a trial's client: it waits an engine outage out
        with SglangClient(engine.url, timeout=60, retries=0, outage_s=120) as trial:

            def restore(i: int) -> str:
                # restarted, answering, generation held: a request sent now waits until the release
                seen["version at restore"] = engine.client.model_info().weight_version
                waiting = threading.Thread(target=lambda: seen.setdefault("held", trial.generate(PROMPT, GREEDY)))
                waiting.start()
                waiting.join(2.0)
                seen["answered while held"] = "held" in seen
                seen["waiting"] = waiting
                engine.client.update_weight_version("4")  # the run's weights, version 4
                return "4"

            with EngineKeeper(
                (engine,), restore, max_restarts=2, startup_timeout_s=120, on_restart=told.append
            ) as keeper:
                os.killpg(engine.pid, signal.SIGKILL)
                # a request sent while the engine is down waits the outage out and is answered once it is back
                during = trial.generate(PROMPT, GREEDY).output_ids
                keeper.settle()
            seen["waiting"].join(30)
        assert engine.pid != first_pid and engine.process.poll() is None
        assert seen["version at restore"] != "4"  # a new process: the label went with the old one
        assert seen["answered while held"] is False  # held until the restore ended
        assert seen["held"].output_ids == before == during  # the same weights: the same greedy reply
        assert engine.client.model_info().weight_version == "4"
        assert [(r.engine, r.exit, r.weight_version, r.error) for r in told] == [(engine.url, "SIGKILL", "4", None)]
        assert keeper.restarts == told and keeper.brought_back == 1 and told[0].seconds > 0
    text = log.read_text()
    assert text.count("grpoflow-engine listening on") == 2 and "grpoflow: restarting" in text


def test_an_engine_past_its_restarts_or_whose_restore_fails_stays_down(tiny_model_dir, tmp_path):
    with start_embedded_engine(tiny_model_dir, log_path=tmp_path / "a.log") as engine:

        def restore(i: int) -> str:
            raise EngineError("weight version 3 is not at hand")

        with EngineKeeper((engine,), restore, max_restarts=1, startup_timeout_s=120) as keeper:
            os.killpg(engine.pid, signal.SIGTERM)
            _wait_until(lambda: keeper.restarts)
            keeper.settle()
        (r,) = keeper.restarts
        assert r.exit == "code 143 (SIGTERM)"  # the server's lifeline passes the signal on as 128 + N
        assert r.error == "restart failed: weight version 3 is not at hand" and r.weight_version is None
        assert engine.process.poll() is not None  # stopped, not left serving the prepared model's weights
        assert not engine.client.health()

    with start_embedded_engine(tiny_model_dir, log_path=tmp_path / "b.log") as engine:
        with EngineKeeper((engine,), lambda i: "0", max_restarts=0, startup_timeout_s=120) as keeper:
            engine.process.kill()
            _wait_until(lambda: keeper.restarts)
            keeper.settle()
        assert [(r.exit, r.error) for r in keeper.restarts] == [
            ("SIGKILL", "not restarted: engine.max_restarts (0) reached")
        ]
        assert engine.process.poll() is not None


def test_pause_holds_new_generations_until_continue(tiny_model_dir, tmp_path):
    with start_embedded_engine(tiny_model_dir, log_path=tmp_path / "engine.log") as engine:
        engine.client.hold_generation()
        assert engine.client.health()  # the control routes answer while paused
        engine.client.update_weight_version("2")
        out: list = []
        waiting = threading.Thread(target=lambda: out.append(engine.client.generate(PROMPT, GREEDY)))
        waiting.start()
        waiting.join(1.5)
        assert out == []
        engine.client.release_generation()
        waiting.join(30)
        assert len(out[0].output_ids) == GREEDY.max_new_tokens and out[0].meta_info.weight_version == "2"
        # SGLang's `in_place` holds as well (the client's `abort` has nothing in flight to abort here)
        engine.client._call("POST", "/pause_generation", {"mode": "in_place"}, dict)
        waiting = threading.Thread(target=lambda: out.append(engine.client.generate(PROMPT, GREEDY)))
        waiting.start()
        waiting.join(1.5)
        assert len(out) == 1
        engine.client.release_generation()
        waiting.join(30)
        assert len(out) == 2


def test_a_lost_replica_restarted_is_back_in_the_weight_syncs_and_the_router(tiny_model_dir, tmp_path):
    """Two replicas behind the router: one found dead at a sync is left out of it and of the router; restarted
    and restored through its reopened sync, it is in both again, and the next sync reaches it."""
    cfg = parse_run_config({"engine": {"embedded": {"replicas": 2}, "weight_sync": {"mode": "distributed"}}})
    trainer = load_trainer(tiny_model_dir, TrainConfig(), seed=0)
    with open_engine(cfg.engine, str(tiny_model_dir), 0, tmp_path / "engine.log") as handle:
        urls, lost = list(handle.replica_urls), handle.processes[1]
        with open_weight_sync(cfg, urls, trainer, router=handle.router) as syncs:
            os.killpg(lost.pid, signal.SIGKILL)
            lost.process.wait()
            assert syncs.push(trainer, "1")["replicas_lost"] == 1
            _wait_until(lambda: healthy_workers(handle.router) == urls[:1])  # taken out in the background
            lost.restart(startup_timeout=120)
            syncs.reopen(1).push(trainer, "1")
            syncs.readmit(1)
            lost.release()
            _wait_until(lambda: sorted(healthy_workers(handle.router)) == sorted(urls))
            moved = syncs.push(trainer, "2")
        assert (moved["replicas"], moved["replicas_lost"]) == (2, 0)
        assert lost.client.model_info().weight_version == "2"
