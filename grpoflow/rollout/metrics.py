"""A step's rollout metrics: rewards, pass rates, truncation, tokens, retries, time, exit statuses, and how varied
the policy's first commands are (a policy that collapses onto one command for every task shows it here first)."""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence

from grpoflow.figures import Figures
from grpoflow.samples import PASS, Sample


def step_metrics(samples: Sequence[Sample], wall_time_s: float, success_threshold: float = PASS) -> Figures:
    """Rollout/evaluate figures of one step. Rewards are averaged over trials that have one.

    A trial is one rollout however many segments it trained as (a compacted session gives several samples with
    one rollout_id, each repeating the trial's reward and metrics): trial-level figures count each rollout once,
    and `tokens_generated` sums every sample's trained tokens (shared tokens are masked in all but one)."""
    tokens_generated = float(sum(s.n_generated for s in samples))
    trials: dict[str, Sample] = {}
    for s in samples:
        trials.setdefault(s.rollout_id, s)  # the first segment stands for its rollout
    samples = list(trials.values())
    n = len(samples)
    scored = [s for s in samples if s.reward is not None]
    groups: dict[str, list[Sample]] = defaultdict(list)
    for s in scored:
        groups[s.group_id].append(s)
    stds = [statistics.pstdev([s.reward for s in g]) for g in groups.values()]
    m: dict[str, float] = {
        "trials": float(n),
        "scored": float(len(scored)),
        "reward_mean": statistics.fmean(s.reward for s in scored) if scored else float("nan"),
        "pass_at_1": statistics.fmean(s.reward >= success_threshold for s in scored) if scored else float("nan"),
        "pass_at_k": statistics.fmean(any(s.reward >= success_threshold for s in g) for g in groups.values())
        if groups
        else float("nan"),
        "group_reward_std_mean": statistics.fmean(stds) if stds else float("nan"),
        "zero_std_group_share": statistics.fmean(sd == 0.0 for sd in stds) if stds else float("nan"),
        "truncated_ratio": sum(s.status == "TRUNCATED" for s in samples) / n if n else float("nan"),
        "tokens_after_truncation": sum(s.metrics.get("tokens_after_truncation", 0.0) for s in samples),
        "tokens_generated": tokens_generated,
        "retries": sum(s.metrics.get("retries", 0.0) for s in samples),
        "trials_retried": float(sum(s.metrics.get("retries", 0.0) > 0 for s in samples)),
    }
    gen = sum(s.metrics.get("generation_time_s", 0.0) for s in samples)
    tool = sum(s.metrics.get("tool_time_s", 0.0) for s in samples)
    trial_wall = sum(s.metrics.get("trial_wall_time_s", 0.0) for s in samples)
    # Summed over trials (they overlap in time): what each trial spent generating, in tools, and in between.
    seconds = {
        "wall_time_s": wall_time_s,
        "generation_time_s": gen,
        "tool_time_s": tool,
        "overhead_time_s": max(0.0, trial_wall - gen - tool),
    }
    if any("requests" in s.metrics for s in samples):  # trials through the session server (grpoflow.rollout.sessions)
        requests = sum(s.metrics.get("requests", 0.0) for s in samples)
        m["session/requests"] = requests
        m["session/segments"] = sum(s.metrics.get("segments", 1.0) for s in samples)
        m["session/refused_requests"] = sum(s.metrics.get("refused_requests", 0.0) for s in samples)
        m["session/abandoned_turns"] = sum(s.metrics.get("abandoned_turns", 0.0) for s in samples)
        # how often tokenising the re-sent history would NOT have given the tokens the policy produced
        m["session/retokenize_mismatch_rate"] = (
            sum(s.metrics.get("retokenize_mismatches", 0.0) for s in samples) / requests if requests else 0.0
        )
    for status, count in Counter(s.exit_status for s in samples).items():
        m[f"exit/{status}"] = float(count)
    m.update(first_command_spread(samples))
    return Figures(m, seconds)


_FENCED = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.S)


def first_command(sample: Sample) -> str | None:
    """The program the trial's first reply runs: the first word of its first fenced block (else of the reply),
    e.g. `echo` for "```bash\necho hi > /app/x\n```"; None without an assistant reply in the sample."""
    reply = next((m.get("content") for m in sample.messages if m.get("role") == "assistant"), None)
    if not isinstance(reply, str):
        return None
    block = _FENCED.search(reply)
    for line in (block.group(1) if block else reply).splitlines():
        if words := line.split():
            return words[0]
    return None


def first_command_spread(trials: Sequence[Sample]) -> dict[str, float]:
    """Over the step's trials (one sample each): the entropy in bits of their first commands and the share of the
    most common one. Different tasks want different commands, so a share near 1 is a collapse (one command
    for everything), whatever the rewards say. Empty when no trial has a reply to read."""
    commands = Counter(c for s in trials if (c := first_command(s)) is not None)
    n = sum(commands.values())
    if not n:
        return {}
    entropy = -sum(k / n * math.log2(k / n) for k in commands.values())
    return {"first_command_entropy": entropy + 0.0, "first_command_top_share": max(commands.values()) / n}
