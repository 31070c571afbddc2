"""The record of one session: every token the policy saw or produced, as a tree of token spans, plus its turns.

A session is one trial's conversation with the policy through the session server. Each request (a "turn") is a
prompt and the engine's output. All turns' token sequences (prompt + output) are kept in one radix tree: a
request that extends an earlier turn walks that turn's exact tokens and adds only its new suffix; a request
that starts a new context (a compaction, a sub-agent) walks the tree as far as its tokens agree (the longest
common token prefix) and branches there. Each token position exists once in the tree, with its loss mask
(1 = the policy generated it) and the engine's logprob; `grpoflow.rollout.sessions.segments` turns the root-to-leaf
paths into training samples, training every position once.

A turn that ended with finish_reason `length` (cut off, not ended by EOS) closes its path: the server refuses
any request whose tokens run through the end of that turn. A turn whose reply the harness never used (its next request
repeated the same messages, or it hung up before the reply) is abandoned: a path is trained only up to its last
used turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Node:
    """A run of tokens [start, start + len(tokens)) of every path below it; children keyed by first token."""

    parent: Node | None
    start: int
    tokens: list[int]
    mask: list[int]
    logprobs: list[float]
    children: dict[int, Node] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def _split(self, depth: int) -> Node:
        """Cut this node at absolute `depth` (start < depth < end): a new head node takes the first part and
        this node keeps the tail, so references (node, depth) to the tail stay valid; returns the head."""
        k = depth - self.start
        head = Node(self.parent, self.start, self.tokens[:k], self.mask[:k], self.logprobs[:k])
        assert self.parent is not None  # the root is empty and never split
        self.parent.children[head.tokens[0]] = head
        head.children[self.tokens[k]] = self
        self.parent, self.start = head, depth
        del self.tokens[:k], self.mask[:k], self.logprobs[:k]
        return head


@dataclass(frozen=True)
class Mark:
    """A position in the tree: the path from the root through `depth` tokens, ending in (or above) `node`.

    Splits only insert nodes above an existing one, so a mark stays valid: `resolve` walks up to the node that
    now holds token `depth - 1`.
    """

    node: Node
    depth: int

    def resolve(self) -> Node:
        n = self.node
        while n.start >= self.depth and n.parent is not None:
            n = n.parent
        return n


@dataclass
class Turn:
    """One chat request of the session and what the engine answered."""

    index: int
    messages: list[dict[str, Any]]  # the request's messages as the template saw them (role, content, ...)
    reply: str  # the assistant content returned to the harness
    prompt_len: int
    output_ids: list[int]
    finish_reason: str  # "stop" or "length" (OpenAI names)
    truncated: bool  # finish_reason length and the output did not end with EOS: the path is closed
    extends: int | None  # the turn whose exact tokens this prompt reused (messages matched), or None
    retokenize_mismatch: bool  # tokenising the whole rendered history gives other ids than the prompt used
    first_mismatch: int | None  # the first position where they differ
    weight_version: str | None
    generation_time_s: float
    end: Mark = field(repr=False)  # the end of prompt + output in the tree
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, top_k, sampling_seed used
    abandoned: bool = False  # the harness never used the reply (it asked again, or hung up): never trained
    own_limit: bool = False  # the harness asked for fewer tokens than the run allows (`side_requests`)

    def summary(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "prompt_len": self.prompt_len,
            "n_output": len(self.output_ids),
            "finish_reason": self.finish_reason,
            "truncated": self.truncated,
            "extends": self.extends,
            "retokenize_mismatch": self.retokenize_mismatch,
            "first_mismatch": self.first_mismatch,
            "weight_version": self.weight_version,
            "generation_time_s": round(self.generation_time_s, 4),
            "sampling": self.sampling,
            "abandoned": self.abandoned,
        }


class SessionTree:
    """The token tree and turns of one session. Not thread-safe: the server serialises a session's requests."""

    def __init__(self, session_id: str):
        self.session_id = session_id
        self.root = Node(None, 0, [], [], [])
        self.turns: list[Turn] = []
        # message-prefix key (the turn's messages + its reply) -> turn index, to find the turn a request extends
        self._states: dict[tuple, int] = {}
        self._continued: set[int] = set()  # turns a later request continued (their reply was used)
        self.engine_failures = 0  # requests the engine did not answer within its outage budget
        # What the engine's last failed try got while a request still waits an outage out (None once it answers):
        # set when the session ends, the harness was cut off by the outage (`segment_samples`).
        self.engine_outage: str | None = None
        self.refused = 0  # requests refused because they extended a closed (truncated) path
        self.extend_failures = 0  # requests that continued a turn the template could not extend token-exactly

    # --- reading ----------------------------------------------------------------------------------------

    def path(self, mark: Mark) -> tuple[list[int], list[int], list[float]]:
        """(tokens, loss mask, logprobs) from the root to `mark`."""
        node = mark.resolve()
        parts = []
        keep = mark.depth - node.start
        while node is not None:
            parts.append((node.tokens[:keep], node.mask[:keep], node.logprobs[:keep]))
            node = node.parent
            keep = len(node.tokens) if node is not None else 0
        parts.reverse()
        return ([t for p in parts for t in p[0]], [m for p in parts for m in p[1]], [x for p in parts for x in p[2]])

    def leaves(self) -> list[Mark]:
        """The end of every root-to-leaf path, in the order the leaves were created (depth-first by child age)."""
        out: list[Mark] = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            if not n.children:
                if n is not self.root:
                    out.append(Mark(n, n.end))
                continue
            stack.extend(reversed(list(n.children.values())))
        return out

    def common_prefix(self, ids: list[int]) -> tuple[int, list[Node]]:
        """How many leading tokens of `ids` the tree already holds, and the nodes that path runs through."""
        node, depth, nodes = self.root, 0, []
        while depth < len(ids):
            child = node.children.get(ids[depth])
            if child is None:
                break
            nodes.append(child)
            n = _agree(child.tokens, ids, depth)
            depth += n
            if n < len(child.tokens):
                break
            node = child
        return depth, nodes

    def closed_prefix(self, ids: list[int]) -> Turn | None:
        """The truncated turn whose whole token path is a prefix of `ids` (a request running through it), if any."""
        closed = [t for t in self.turns if t.truncated]
        if not closed:
            return None
        depth, nodes = self.common_prefix(ids)
        on_path = {id(n) for n in nodes}
        for t in closed:
            if t.end.depth <= depth and id(t.end.resolve()) in on_path:
                return t
        return None

    def extended_turn(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> Turn | None:
        """The turn with the longest message history (its messages + its reply) that `messages` continue, offered
        the same `tools`: a new tool list renders another prompt (the tools sit in the system turn), so a turn
        asked with other tools is no prefix to reuse."""
        keys = [_msg_key(m) for m in messages]
        for k in range(len(keys) - 1, 0, -1):  # at least one new message after the matched state
            if keys[k - 1][0] != "assistant":
                continue
            i = self._states.get((_tools_key(tools), *keys[:k]))
            if i is not None:
                return self.turns[i]
        return None

    # --- writing ----------------------------------------------------------------------------------------

    def add_turn(
        self,
        messages: list[dict[str, Any]],
        prompt_ids: list[int],
        output_ids: list[int],
        output_logprobs: list[float],
        *,
        reply: str,
        finish_reason: str,
        truncated: bool,
        extends: int | None,
        retokenize_mismatch: bool,
        first_mismatch: int | None,
        weight_version: str | None,
        generation_time_s: float,
        sampling: dict[str, Any] | None = None,
        tools: list[dict] | None = None,
        own_limit: bool = False,
    ) -> Turn:
        if len(output_ids) != len(output_logprobs):
            raise ValueError(f"{len(output_ids)} output ids but {len(output_logprobs)} logprobs")
        # A request that repeats the previous request's messages is a retry (a client timeout, a re-ask): the
        # reply it never went on from was not used. (An earlier turn asked again later, after other requests, is
        # a harness re-sending a state, not a retry.) A turn a request continues was used, whatever else said so.
        asked = tuple(_msg_key(m) for m in messages)
        last = self.turns[-1] if self.turns else None
        if last is not None and last.index not in self._continued and _asked_key(last) == asked:
            last.abandoned = True
        if (prev := self.extended_turn(messages, tools)) is not None:
            self._continued.add(prev.index)
            prev.abandoned = False
        self._insert(prompt_ids, [0] * len(prompt_ids), [0.0] * len(prompt_ids))
        end = self._insert(
            prompt_ids + output_ids,
            [0] * len(prompt_ids) + [1] * len(output_ids),
            [0.0] * len(prompt_ids) + list(output_logprobs),
        )
        turn = Turn(
            index=len(self.turns),
            messages=messages,
            reply=reply,
            prompt_len=len(prompt_ids),
            output_ids=list(output_ids),
            finish_reason=finish_reason,
            truncated=truncated,
            extends=extends,
            retokenize_mismatch=retokenize_mismatch,
            first_mismatch=first_mismatch,
            weight_version=weight_version,
            generation_time_s=generation_time_s,
            end=end,
            sampling=dict(sampling or {}),
            own_limit=own_limit,
        )
        self.turns.append(turn)
        self._states[(_tools_key(tools), *asked, ("assistant", reply))] = turn.index
        return turn

    def abandon(self, turn: Turn) -> None:
        """The harness hung up before it got `turn`'s reply: the reply is never trained."""
        turn.abandoned = True

    def _insert(self, ids: list[int], mask: list[int], logprobs: list[float]) -> Mark:
        """Walk/extend the tree with `ids`. Positions the tree already holds keep their tokens; a generated
        position (mask 1) upgrades a held position that was prompt (the same token in the same context is a
        policy token), so the tree's mask is the union of all turns' masks. Returns the mark of the last token."""
        node, depth = self.root, 0
        while depth < len(ids):
            child = node.children.get(ids[depth])
            if child is None:
                new = Node(node, depth, ids[depth:], mask[depth:], logprobs[depth:])
                node.children[ids[depth]] = new
                return Mark(new, len(ids))
            n = _agree(child.tokens, ids, depth)
            if 1 in mask[depth : depth + n]:
                for j in range(n):
                    if mask[depth + j] and not child.mask[j]:
                        child.mask[j], child.logprobs[j] = 1, logprobs[depth + j]
            if n < len(child.tokens) and depth + n < len(ids):  # diverges inside the child: split it there
                node = child._split(depth + n)
                depth += n
                continue
            depth += n
            node = child
        return Mark(node, len(ids))

    # --- reporting --------------------------------------------------------------------------------------

    @property
    def mismatch_rate(self) -> float:
        """Share of requests whose re-tokenised history differs from the tokens the policy was given."""
        return sum(t.retokenize_mismatch for t in self.turns) / len(self.turns) if self.turns else 0.0

    def side_requests(self) -> set[int]:
        """Turns beside the episode: one-off requests (they extend no turn and no turn extends them) with a token
        limit of the harness's own, in a session that has other turns, such as opencode's title request. They
        are not the policy acting in its task: never trained, and a cut one does not make the trial over-long."""
        side = {t.index for t in self.turns if t.own_limit and t.extends is None and t.index not in self._continued}
        return side if len(side) < len(self.turns) else set()

    def stats(self) -> dict[str, float]:
        n = len(self.turns)
        side = self.side_requests()
        return {
            "requests": float(n),
            "requests_extended": float(sum(t.extends is not None for t in self.turns)),
            "retokenize_mismatches": float(sum(t.retokenize_mismatch for t in self.turns)),
            "retokenize_mismatch_rate": self.mismatch_rate,
            "truncated_turns": float(sum(t.truncated and not t.abandoned and t.index not in side for t in self.turns)),
            "side_requests": float(len(side)),
            "abandoned_turns": float(sum(t.abandoned for t in self.turns)),
            "refused_requests": float(self.refused),
            "extend_failures": float(self.extend_failures),
            "engine_failures": float(self.engine_failures),
            "generation_time_s": sum(t.generation_time_s for t in self.turns),
        }


def _agree(tokens: list[int], ids: list[int], at: int) -> int:
    """How many leading `tokens` equal `ids[at:]` (list comparisons run in C; long shared prefixes are common)."""
    lim = min(len(tokens), len(ids) - at)
    if tokens[:lim] == ids[at : at + lim]:
        return lim
    n = 0
    while tokens[n] == ids[at + n]:
        n += 1
    return n


def _tools_key(tools: list[dict] | None) -> str:
    """What must be equal for two requests to offer the same tools: the list, in its order, as JSON."""
    return json.dumps(tools or [], sort_keys=True, default=str)


def _asked_key(turn: Turn) -> tuple:
    return tuple(_msg_key(m) for m in turn.messages)


def _msg_key(m: dict[str, Any]) -> tuple:
    """What must be equal for two messages to be the same turn of history: role, text, and tool-call fields."""
    extra = tuple(sorted((k, repr(v)) for k, v in m.items() if k in ("tool_calls", "tool_call_id", "name") and v))
    return (m.get("role"), m.get("content") or "") + extra
