"""terminus-2 (Harbor's own agent) in the train flow: harness chosen by config, every policy call through the
session server, samples trained.

The policy server is a stand-in at the GPU-server boundary (SGLang's HTTP API, tests/fakes/sglang_standin.py)
whose replies are terminus-2 JSON that solves the task on the turns of the group's second trial (told apart by the
sampling seeds the session server derives from its trial seed) and not on the first's, so the GRPO group of 2 has
reward spread and the step really trains. Everything else is real: Harbor's terminus-2 driving
tmux in the local sandbox, the task's verifier, the session server, and the trainer on the tiny model over the
exact tokens the stand-in produced."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flows.train import train_flow
from grpoflow.config import parse_run_config
from grpoflow.prepare.dataset import builtin_dataset_path
from grpoflow.run.metrics import read_metrics
from grpoflow.seeds import trial_seed, turn_seed
from grpoflow.tokens import load_tokenizer
from tests.fakes.scripted_openai import terminus_json
from tests.fakes.sglang_standin import ScriptedModel, StandinServer

pytestmark = [
    pytest.mark.flow,
    pytest.mark.skipif(shutil.which("bwrap") is None or shutil.which("tmux") is None, reason="needs bwrap and tmux"),
]

SOLVE = terminus_json(["echo hello > /app/hello.txt"], done=True)
MISS = terminus_json(["ls /app"], done=True)


class TerminusScript(ScriptedModel):
    """Replies with terminus-2 JSON chosen by the request's sampling seed (`solving`: the seeds that solve);
    logprob -0.5 per token."""

    solving: frozenset[int] = frozenset()

    def generate(self, input_ids, sp, return_logprob, rid):
        tok = load_tokenizer(self.model_path)
        seed = int(sp.get("sampling_seed") or 0)
        out = tok.encode(SOLVE if seed in self.solving else MISS, add_special_tokens=False) + [tok.eos_token_id]
        meta = {
            "id": rid or "r",
            "finish_reason": {"type": "stop", "matched": tok.eos_token_id},
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(out),
            "weight_version": self.weight_version,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[-0.5, t, None] for t in out]
        self.calls.append({"input_ids": list(input_ids), "output_ids": out})
        return {"text": tok.decode(out, skip_special_tokens=True), "output_ids": out, "meta_info": meta}


@pytest.fixture
def standin(tiny_model_dir):
    server = StandinServer(str(tiny_model_dir))
    base = server.model
    server.model = TerminusScript(
        model_path=base.model_path,
        served_model_name=base.served_model_name,
        vocab_size=base.vocab_size,
        context_length=8192,
        eos_token_id=base.eos_token_id,
    )
    server.model.calls = []
    with server:
        yield server


def test_terminus2_trains_through_the_session_server(tmp_path, tiny_model_dir, standin):
    tasks = tmp_path / "tasks"
    shutil.copytree(builtin_dataset_path() / "hello-file", tasks / "hello-file")
    cfg = parse_run_config(
        {
            "run_id": "t2",
            "output_dir": str(tmp_path / "runs"),
            "model": {"source": str(tiny_model_dir)},
            "dataset": {"path": str(tasks)},
            "prompts": {"eval_fraction": 0.0},
            "engine": {"backend": "sglang", "url": standin.url},
            "rollout": {
                "prompts_per_step": 1,
                "n_samples_per_prompt": 2,
                "harness": {"name": "terminus-2"},
                "episode": {"max_turns": 3, "max_context_tokens": 8192},
                "sampling": {"max_new_tokens": 256, "temperature": 1.0},
            },
            # the stand-in scripts terminus-2's replies: its logprobs are not the model's, so no agreement probe
            "train": {
                "steps": 1,
                "max_probe_logprob_gap": None,
                "optimizer": {"learning_rate": 1e-3},
                "eval": {"samples_per_prompt": 0},
            },
        }
    )
    # The turn seeds of trial 1 of step 0's group (`grpoflow.seeds`): that trial solves the task, trial 0 does not.
    trial = trial_seed(cfg.seed, 0, "hello-file", 1)
    standin.model.solving = frozenset(turn_seed(trial, turn) for turn in range(cfg.rollout.episode.max_turns))
    last = train_flow(cfg)

    root = tmp_path / "runs" / "t2"
    samples = [json.loads(line) for line in (root / "details" / "step_0" / "samples.jsonl").read_text().splitlines()]
    rewards = sorted(s["reward"] for s in samples)
    assert rewards == [0.0, 1.0], "one trial of the group solved the task, one did not"
    # Token-exact: each trained span is one reply exactly as the policy generated it (ids, not re-tokenised text).
    produced = {tuple(c["output_ids"]) for c in standin.model.calls}
    for s in samples:
        spans = _trained_spans(s["tokens"], s["loss_mask"])
        assert spans and all(span in produced for span in spans)
        assert s["metrics"]["requests"] == len(spans) and s["metrics"]["segments"] == 1
    [m] = read_metrics(root / "metrics.jsonl")
    assert m["rollout/session/requests"] == sum(s["metrics"]["requests"] for s in samples)
    assert last["train/n_samples"] == 2 and last["train/optimizer_steps"] == 1
    before = load_file(Path(tiny_model_dir) / "model.safetensors")
    after = load_file(root / "checkpoints" / "step_0" / "model.safetensors")
    assert any(not before[k].equal(after[k]) for k in before), "the step changed the weights"


def _trained_spans(tokens: list[int], mask: list[int]) -> list[tuple[int, ...]]:
    spans, cur = [], []
    for t, m in zip(tokens, mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            spans.append(tuple(cur))
            cur = []
    return spans + ([tuple(cur)] if cur else [])


def test_terminus2_cut_off_by_its_time_limit_while_the_engine_is_down_is_not_scored(tmp_path, standin):
    """The engine answers 503 throughout and the session server waits the outage out (`engine.outage_wait_s`), past
    the task's 5 s agent limit: Harbor cuts terminus-2 off and verifies the untouched workdir (reward 0), but that
    episode was the engine's doing, never the policy's: FAILED EngineError, no reward, its group not trained."""
    tasks = tmp_path / "tasks"
    shutil.copytree(builtin_dataset_path() / "hello-file", tasks / "hello-file")
    toml = tasks / "hello-file" / "task.toml"
    toml.write_text(toml.read_text().replace("[agent]\ntimeout_sec = 120.0", "[agent]\ntimeout_sec = 5.0"))
    standin.faults.inject("5xx", times=None)
    cfg = parse_run_config(
        {
            "run_id": "t2-down",
            "output_dir": str(tmp_path / "runs"),
            "model": {"source": str(standin.model.model_path)},
            "dataset": {"path": str(tasks)},
            "prompts": {"eval_fraction": 0.0},
            "engine": {"backend": "sglang", "url": standin.url, "outage_wait_s": 600},
            "rollout": {
                "prompts_per_step": 1,
                "n_samples_per_prompt": 2,
                "harness": {"name": "terminus-2"},
                "sampling": {"max_new_tokens": 64},
                "episode": {"max_context_tokens": 8192},
                "sandbox": {"retries": 0},
            },
            "train": {"steps": 1, "max_probe_logprob_gap": None, "eval": {"samples_per_prompt": 0}},
        }
    )
    train_flow(cfg)
    root = tmp_path / "runs" / "t2-down"
    samples = [json.loads(line) for line in (root / "details" / "step_0" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2
    for s in samples:
        assert (s["status"], s["exit_status"], s["reward"]) == ("FAILED", "EngineError", None), s["exit_reason"]
        assert s["exit_reason"].startswith("the agent's time ran out while the engine did not answer")
    assert read_metrics(root / "metrics.jsonl")[0]["train/n_samples"] == 0
