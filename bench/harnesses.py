"""Per-turn overhead of each harness in the local sandbox, side by side in one run: our shell agent, terminus-2, and
the real claude-code and opencode CLIs (prepare's pinned npm installs, through the sandbox's bridge to the session
server).

    .venv/bin/python bench/harnesses.py [--trials 4] [--harness shell,terminus-2,claude-code,opencode]

Every harness solves the built-in `hello-file` task against a scripted policy (a scripted SGLang `/generate`,
tests/fakes/scripted_engine.py: exact tokens, generation costs ~0), in its own format: one command, then "done".
For each trial Harbor's timings give the sandbox start, the agent's setup (the CLI install check), the agent's run
and the verifier; the policy's turns and generation seconds come from the session server (or the shell agent's
own record). "per turn" is (agent run - generation) / policy turns: what the harness itself adds to each turn of
an episode (its process start spread over the turns, its prompt building, tool execution, HTTP through the
bridge), the figure to set beside a real model's generation time per turn. opencode's turns include the title it
asks the policy for. Trials run one at a time. Beside it a baseline (HF `generate` tokens/s on
one thread): this machine's speed varies from day to day.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.main_job import hf_generate_tok_s  # noqa: E402
from grpoflow.prepare.clis import CLI_PACKAGES, ensure_cli  # noqa: E402
from grpoflow.prepare.model import prepare_model  # noqa: E402
from grpoflow.tokens import load_tokenizer  # noqa: E402
from tests.fakes.rollout_step import scripted_task_step  # noqa: E402
from tests.fakes.scripted_engine import Reply  # noqa: E402
from tests.fakes.scripted_openai import terminus_json  # noqa: E402
from tests.fakes.tiny_model import build_tiny_model  # noqa: E402

# The command's output (bench-42) differs from its text (bench-$((40+2))): the policy answers "done" once the
# output came back, whatever the harness echoes of the command itself.
COMMAND = "echo hello > /app/hello.txt && echo bench-$((40+2))"
SEEN = "bench-42"


def first_reply(harness: str) -> str:
    if harness == "shell":
        return f"```bash\n{COMMAND}\n```"
    if harness == "terminus-2":
        return terminus_json([COMMAND])
    name, extra = ("Bash", {}) if harness == "claude-code" else ("bash", {"description": "write the file"})
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {"command": COMMAND, **extra}}) + "\n</tool_call>"


def last_reply(harness: str) -> str:
    return {"shell": "DONE", "terminus-2": terminus_json([], done=True)}.get(harness, "Done.")


def seconds(timing: dict | None) -> float:
    if not timing or not timing.get("started_at") or not timing.get("finished_at"):
        return 0.0
    t0, t1 = (datetime.fromisoformat(timing[k].replace("Z", "+00:00")) for k in ("started_at", "finished_at"))
    return (t1 - t0).total_seconds()


def run(harness: str, model: Path, trials: int, out: Path) -> list[dict]:
    if harness in CLI_PACKAGES:
        ensure_cli(harness)
    tok = load_tokenizer(str(model))

    def script(ids: list[int], i: int) -> Reply:
        prompt = tok.decode(ids)
        if "title generator" in prompt:  # opencode names its session with a request of its own
            return Reply(text="Hello file")
        return Reply(text=last_reply(harness) if SEEN in prompt else first_reply(harness))

    rollout = {"harness": harness, "n_samples_per_prompt": trials, "concurrency": 1, "max_context_tokens": 100_000}
    res, _ = scripted_task_step(str(model), script, rollout, out)
    rows = []
    for sample in res.samples:
        if sample.segment_index:
            continue
        attempts = sorted((out / "trials").glob(f"{sample.instance_id}__{sample.sample_index}__a*/result.json"))
        result = json.loads(attempts[-1].read_text())
        m = sample.metrics
        turns = m.get("requests", m.get("policy_calls", 0.0))
        rows.append(
            {
                "reward": sample.reward,
                "turns": turns,
                "generation_s": m.get("generation_time_s", 0.0),
                "sandbox_s": seconds(result.get("environment_setup")),
                "setup_s": seconds(result.get("agent_setup")),
                "agent_s": seconds(result.get("agent_execution")),
                "verifier_s": seconds(result.get("verifier")),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--harness", default="shell,terminus-2,claude-code,opencode")
    args = ap.parse_args()
    smol = prepare_model("smollm2-135m-instruct").path
    print(f"baseline: HF generate {hf_generate_tok_s(smol):.1f} tok/s on one thread")
    with tempfile.TemporaryDirectory(prefix="grpoflow-bench-harnesses-") as tmp:
        model = build_tiny_model(Path(tmp) / "tiny", seed=0)  # the scripted policy needs only its tokenizer
        head = f"{'harness':<12} {'trials':>6} {'reward':>6} {'turns':>5} | {'sandbox s':>9} {'setup s':>8} "
        print(head + f"{'agent s':>8} {'verify s':>8} | {'per turn s':>10} {'vs shell':>8}")
        shell_turn = None
        for harness in args.harness.split(","):
            rows = run(harness, model, args.trials, Path(tmp) / harness)
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            per_turn = statistics.median((r["agent_s"] - r["generation_s"]) / max(r["turns"], 1) for r in rows)
            if harness == "shell":
                shell_turn = per_turn
            ratio = f"{per_turn / shell_turn:8.1f}" if shell_turn else f"{'-':>8}"
            print(
                f"{harness:<12} {len(rows):>6} {med['reward']:>6.2f} {med['turns']:>5.0f} | {med['sandbox_s']:>9.2f} "
                f"{med['setup_s']:>8.2f} {med['agent_s']:>8.2f} {med['verifier_s']:>8.2f} | {per_turn:>10.3f} {ratio}"
            )


if __name__ == "__main__":
    main()
