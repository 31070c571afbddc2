"""The trajectory viewer: `viewer.html` in the run dir, one self-contained page (no scripts, no network) to read
what the agent did.

Per step (training steps, then evaluations), per GRPO group: the best trial (highest reward) and the worst (lowest
reward; a trial without a verdict counts lowest), each with its reward, status, exit status and reason, turns,
generated tokens and retries, and the conversation: the task, every reply of the policy and every command's output
as the agent saw it. A trial cut off at `max_new_tokens` (TRUNCATED) says where: its last reply is the cut one.
"""

from __future__ import annotations

import html
import re
from collections import defaultdict
from pathlib import Path

from grpoflow.fileio import write_text_atomic
from grpoflow.paths import RunPaths
from grpoflow.rollout.journal import SAMPLES, read_samples
from grpoflow.samples import Sample

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0 auto;max-width:1100px;padding:1em 2em;color:#222}
h1{font-size:1.4em}h2{border-bottom:2px solid #ccc;margin-top:2em}h3{margin:1.2em 0 .3em;font-size:1.05em}
.pair{display:grid;grid-template-columns:1fr 1fr;gap:1em}.trial{border:1px solid #ccc;border-radius:6px;padding:.5em}
.best{border-color:#3a3}.worst{border-color:#c33}.meta{font-size:.9em;color:#444;margin-bottom:.4em}
.msg{margin:.3em 0;padding:.3em .5em;border-radius:4px;white-space:pre-wrap;word-break:break-word;font-size:.88em}
.system{background:#f3f3f3}.user{background:#eef4ff}.assistant{background:#effaef}.cut{outline:2px dashed #c33}
.tag{display:inline-block;padding:0 .4em;border-radius:3px;background:#eee;margin-right:.3em}
nav a{margin-right:.8em}
"""


def _order(details_dir: Path) -> tuple[int, int]:
    kind, _, n = details_dir.name.partition("_")
    return (0 if kind == "step" else 1, int(n) if n.isdigit() else 0)


MAX_MESSAGE_CHARS = 4000  # a longer message (a command's flood of output) is cut: the page stays readable


def _trials(samples: list[Sample]) -> dict[str, list[Sample]]:
    """group id -> its trials, in sample order: a compacted trial's segments joined into one (all their messages
    in order, their generated tokens summed; it stands under its first segment's id and verdict)."""
    segments: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        segments[s.rollout_id].append(s)
    groups: dict[str, list[Sample]] = defaultdict(list)
    for parts in segments.values():
        parts.sort(key=lambda s: s.segment_index)
        first = parts[0]
        if len(parts) > 1:
            marked = []
            for p in parts:
                marked += [{"role": "system", "content": f"(segment {p.segment_index})"}, *p.messages]
            first = first.model_copy(update={"messages": marked, "loss_mask": [m for p in parts for m in p.loss_mask]})
        groups[first.group_id].append(first)
    return groups


def best_and_worst(trials: list[Sample]) -> tuple[Sample, Sample]:
    """The highest reward and the lowest (no verdict is lowest); the first on ties."""
    score = [(s.reward if s.reward is not None else float("-inf")) for s in trials]
    best = trials[max(range(len(trials)), key=lambda i: (score[i], -i))]
    worst = trials[min(range(len(trials)), key=lambda i: (score[i], i))]
    return best, worst


def _trial_html(s: Sample, label: str) -> str:
    reward = "no verdict" if s.reward is None else f"{s.reward:g}"
    meta = [
        f"<span class=tag>{label}</span><b>{html.escape(s.rollout_id)}</b>",
        f"reward {reward}",
        f"{html.escape(s.status)} / {html.escape(s.exit_status)}",
        f"{int(s.metrics.get('turns', 0))} turns",
        f"{s.n_generated} generated tokens",
        f"{int(s.metrics.get('retries', 0))} retries",
    ]
    if s.exit_reason:
        meta.append(f"reason: {html.escape(s.exit_reason)}")
    last_reply = max((i for i, m in enumerate(s.messages) if m.get("role") == "assistant"), default=-1)
    msgs = []
    for i, m in enumerate(s.messages):
        role = re.sub(r"[^a-z]", "", str(m.get("role", "")))
        cut = s.status == "TRUNCATED" and i == last_reply
        note = "<br><i>(cut off here: the turn reached max_new_tokens)</i>" if cut else ""
        content = m.get("content")
        text = content if isinstance(content, str) else str(content)
        if len(text) > MAX_MESSAGE_CHARS:
            text = text[:MAX_MESSAGE_CHARS] + f"\n… ({len(text) - MAX_MESSAGE_CHARS} more characters)"
        msgs.append(f"<div class='msg {role}{' cut' if cut else ''}'><b>{role}</b>: {html.escape(text)}{note}</div>")
    kind = label if label in ("best", "worst") else "alike"
    return f"<div class='trial {kind}'><div class=meta>{' · '.join(meta)}</div>{''.join(msgs)}</div>"


def render_viewer(paths: RunPaths, run_id: str) -> str:
    sections, nav = [], []
    root = paths.all_details
    details = [d for d in root.glob("*") if (d / SAMPLES).is_file()] if root.is_dir() else []
    for d in sorted(details, key=_order):
        groups = _trials(read_samples(d))
        anchor = html.escape(d.name)
        nav.append(f"<a href='#{anchor}'>{anchor}</a>")
        parts = [f"<h2 id='{anchor}'>{anchor}</h2>"]
        for group, trials in groups.items():
            best, worst = best_and_worst(trials)
            rewards = ", ".join("-" if t.reward is None else f"{t.reward:g}" for t in trials)
            parts.append(f"<h3>{html.escape(group)} <small>(rewards {rewards})</small></h3>")
            if worst is best:  # every reward alike: one stands for all
                pair = _trial_html(best, f"all {len(trials)} alike")
            else:
                pair = _trial_html(best, "best") + _trial_html(worst, "worst")
            parts.append(f"<div class=pair>{pair}</div>")
        sections.append("\n".join(parts))
    title = f"Trajectories of run {html.escape(run_id)}"
    body = "\n".join(sections) or "<p>No finished step yet.</p>"
    return (
        f"<!doctype html><html><head><meta charset=utf-8><title>{title}</title><style>{_CSS}</style></head>"
        f"<body><h1>{title}</h1><p>The best and the worst trial of every group, per step.</p>"
        f"<nav>{''.join(nav)}</nav>\n{body}</body></html>\n"
    )


def write_viewer(paths: RunPaths, run_id: str) -> Path:
    """(Re)write `viewer.html` in the run dir; returns its path."""
    out = paths.viewer
    write_text_atomic(out, render_viewer(paths, run_id))
    return out
