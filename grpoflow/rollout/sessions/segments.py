"""A session's tree -> training samples: one `Sample` per linear segment (root-to-leaf path).

Every segment of a trial is the same rollout: it carries the trial's `rollout_id`, reward, status and exit status
(copied from the trial's own sample, as `grpoflow.rollout.outcome.to_sample` built it), and `group_advantages` counts the
rollout once in its GRPO group. A token position that several segments share (a common prefix that holds
generated tokens, e.g. the history a summarisation request and the main loop both continue) is trained in the
first segment that holds it and loss-masked in the others, so it trains once. A path is trained only up to its last
used turn: a reply the harness never used (an abandoned turn) at its end is cut off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grpoflow.rollout.sessions.tree import Mark, Node, SessionTree
from grpoflow.samples import Sample


@dataclass
class Segment:
    tokens: list[int]
    loss_mask: list[int]  # 1 only where this segment trains the position (shared positions train once)
    rollout_logprobs: list[float]
    prompt_len: int  # tokens before the path's first generated token
    turns: list[int]  # indices of the session's turns that end on this path, in order
    messages: list[dict[str, Any]]  # the last turn's messages and its reply
    weight_version: str | None  # the engine's weight version at the path's first (oldest) turn
    truncated: bool  # the path's last turn was cut off at the token limit


def segments(tree: SessionTree) -> list[Segment]:
    """The session's linear segments, each position's training assigned to the first segment holding it."""
    owned: set[tuple[int, int]] = set()  # (id(node), offset) positions already trained by an earlier segment
    out = []
    ends = _turn_ends(tree)
    side = tree.side_requests()
    emitted: set[tuple[int, int]] = set()  # (id(node), depth) of the segment ends so far
    for leaf in tree.leaves():
        turn_ids = sorted(
            i
            for n in _chain(leaf)
            for i in ends.get(id(n), [])
            if tree.turns[i].end.depth <= leaf.depth and not tree.turns[i].abandoned and i not in side
        )
        if not turn_ids:
            continue  # only abandoned replies or side requests made this path
        # a path that goes on past its last used turn (an abandoned reply at its end) is cut there
        deepest = max(turn_ids, key=lambda i: tree.turns[i].end.depth)
        end = leaf if tree.turns[deepest].end.depth == leaf.depth else tree.turns[deepest].end
        key = (id(end.resolve()), end.depth)
        if key in emitted:
            continue
        emitted.add(key)
        chain = _chain(end)
        tokens, mask, logprobs = tree.path(end)
        train = list(mask)
        pos = 0
        for node in chain:  # root-first
            for off in range(min(len(node.tokens), len(tokens) - node.start)):
                if node.mask[off]:
                    key = (id(node), off)
                    if key in owned:
                        train[pos] = 0
                    else:
                        owned.add(key)
                pos += 1
        last = tree.turns[turn_ids[-1]]
        oldest = tree.turns[turn_ids[0]]  # a segment is as stale as its oldest turn (versions only grow)
        out.append(
            Segment(
                tokens=tokens,
                loss_mask=train,
                rollout_logprobs=logprobs,
                prompt_len=next((i for i, m in enumerate(mask) if m), len(tokens)),
                turns=turn_ids,
                messages=last.messages + [{"role": "assistant", "content": last.reply}],
                weight_version=oldest.weight_version,
                truncated=last.truncated,
            )
        )
    return out


def segment_samples(trial: Sample, tree: SessionTree) -> list[Sample]:
    """The trial's samples: `trial` (its reward, status, ids and metrics; its tokens are ignored) once per segment.

    A session with no turns still gives one (empty) sample, so the rollout keeps its place in its GRPO group.
    A session with a turn cut off at the token limit makes a COMPLETED trial TRUNCATED
    (`SequenceLengthLimitExceeded`), as `grpoflow.rollout.outcome.classify` does for the shell agent; the reward stands.
    Each sample's metrics gain the session's counters (`requests`, `retokenize_mismatches`, ...) and `segments`
    (trial-level values, repeated on every segment: sum them once per `rollout_id`); `segment_index` orders the
    segments.
    """
    segs = segments(tree)
    stats = tree.stats()
    common: dict[str, Any] = {"metrics": {**trial.metrics, **stats, "segments": float(len(segs))}}
    if stats["engine_failures"] and trial.status == "FAILED":  # the harness died of the engine's outage
        common.update(exit_status="EngineError", exit_reason=f"the engine did not answer; {trial.exit_reason}")
    elif tree.engine_outage is not None and trial.exit_status == "TimeLimitExceeded":
        # The harness's time ran out while its request waited the engine out: Harbor verified an episode the
        # policy never got to finish, and that reward must not train.
        common.update(
            status="FAILED",
            exit_status="EngineError",
            reward=None,
            exit_reason=f"the agent's time ran out while the engine did not answer ({tree.engine_outage})",
        )
    elif stats["truncated_turns"] and trial.status == "COMPLETED":
        common.update(
            status="TRUNCATED",
            exit_status="SequenceLengthLimitExceeded",
            exit_reason="a turn hit the response length limit",
        )
    if not segs:
        return [
            trial.model_copy(
                update={
                    **common,
                    "tokens": [],
                    "loss_mask": [],
                    "rollout_logprobs": [],
                    "prompt_len": 0,
                    "segment_index": 0,
                }
            )
        ]
    return [
        trial.model_copy(
            update={
                **common,
                "segment_index": i,
                "tokens": s.tokens,
                "loss_mask": s.loss_mask,
                "rollout_logprobs": s.rollout_logprobs,
                "prompt_len": s.prompt_len,
                "messages": s.messages,
                "weight_version": s.weight_version or trial.weight_version,
            }
        )
        for i, s in enumerate(segs)
    ]


def _chain(mark: Mark) -> list[Node]:
    node, out = mark.resolve(), []
    while node is not None and node.parent is not None:
        out.append(node)
        node = node.parent
    out.reverse()
    return out


def _turn_ends(tree: SessionTree) -> dict[int, list[int]]:
    ends: dict[int, list[int]] = {}
    for t in tree.turns:
        ends.setdefault(id(t.end.resolve()), []).append(t.index)
    return ends
