"""The session tree on its own: token prefixes shared once, branches, closed paths, segments."""

from grpoflow.rollout.sessions.segments import segments
from grpoflow.rollout.sessions.tree import SessionTree


def _turn(tree, prompt, out, *, truncated=False, messages=None, reply="r", version="1"):
    return tree.add_turn(
        messages or [{"role": "user", "content": str(prompt)}],
        prompt,
        out,
        [-1.0] * len(out),
        reply=reply,
        finish_reason="length" if truncated else "stop",
        truncated=truncated,
        extends=None,
        retokenize_mismatch=False,
        first_mismatch=None,
        weight_version=version,
        generation_time_s=0.0,
    )


def test_paths_survive_splits_and_keep_masks():
    tree = SessionTree("s")
    a = _turn(tree, [1, 2, 3], [10, 11])
    b = _turn(tree, [1, 2, 3, 10, 11, 4], [12])  # extends a
    c = _turn(tree, [1, 2, 9], [13, 14])  # branches inside a's prompt (splits the node)
    assert tree.path(a.end) == ([1, 2, 3, 10, 11], [0, 0, 0, 1, 1], [0.0, 0.0, 0.0, -1.0, -1.0])
    assert tree.path(b.end)[0] == [1, 2, 3, 10, 11, 4, 12] and tree.path(b.end)[1] == [0, 0, 0, 1, 1, 0, 1]
    assert tree.path(c.end) == ([1, 2, 9, 13, 14], [0, 0, 0, 1, 1], [0.0, 0.0, 0.0, -1.0, -1.0])
    # a is a prefix of b: two leaves, not three
    assert sorted(tree.path(m)[0] for m in tree.leaves()) == [[1, 2, 3, 10, 11, 4, 12], [1, 2, 9, 13, 14]]
    assert tree.common_prefix([1, 2, 3, 10, 99])[0] == 4


def test_shared_generated_tokens_train_once():
    tree = SessionTree("s")
    _turn(tree, [1, 2], [10, 11, 12])
    _turn(tree, [1, 2, 10, 11, 12, 5], [20])  # the main loop continues
    _turn(tree, [1, 2, 10, 11, 12, 6], [30, 31])  # a summary request continues the same history
    segs = segments(tree)
    assert len(segs) == 2
    trained = [[t for t, m in zip(s.tokens, s.loss_mask, strict=True) if m] for s in segs]
    assert sorted(trained) == sorted([[10, 11, 12, 20], [30, 31]])
    # every generated position of the tree is trained exactly once over all segments
    assert sum(sum(s.loss_mask) for s in segs) == 3 + 1 + 2


def test_a_segment_is_as_old_as_its_oldest_turn():
    tree = SessionTree("s")
    _turn(tree, [1, 2], [10, 11], version="3")
    _turn(tree, [1, 2, 10, 11, 5], [20], version="4")  # the weights changed between the two turns
    _turn(tree, [7], [30], version="4")  # a fresh context after the change
    assert sorted((s.tokens[0], s.weight_version) for s in segments(tree)) == [(1, "3"), (7, "4")]


def test_a_prompt_that_equals_generated_tokens_inherits_them_once():
    tree = SessionTree("s")
    _turn(tree, [1, 2], [10, 11])
    # a fresh-context request whose tokens happen to run through the generated ones (same tokens, same context)
    _turn(tree, [1, 2, 10, 11, 7], [40])
    _turn(tree, [1, 2, 10, 8], [41])
    segs = segments(tree)
    assert sum(sum(s.loss_mask) for s in segs) == 2 + 1 + 1


def test_closed_prefix_finds_requests_running_through_a_truncated_turn():
    tree = SessionTree("s")
    t = _turn(tree, [1, 2], [10, 11], truncated=True)
    assert tree.closed_prefix([1, 2, 10, 11, 5]) is t
    assert tree.closed_prefix([1, 2, 10, 11]) is t
    assert tree.closed_prefix([1, 2]) is None  # a retry of the same prompt is not a continuation
    assert tree.closed_prefix([1, 2, 10, 12]) is None
    _turn(tree, [1, 2, 10, 12], [3])  # splits the truncated turn's node: its mark must still resolve
    assert tree.closed_prefix([1, 2, 10, 11, 5]) is t
    assert tree.closed_prefix([1, 2, 10, 12, 3]) is None


def test_extended_turn_matches_messages_and_the_reply():
    tree = SessionTree("s")
    sys, u1 = {"role": "system", "content": "s"}, {"role": "user", "content": "a"}
    t0 = _turn(tree, [1], [2], messages=[sys, u1], reply="R")
    nxt = [sys, u1, {"role": "assistant", "content": "R"}, {"role": "user", "content": "b"}]
    assert tree.extended_turn(nxt) is t0
    assert tree.extended_turn([sys, u1, {"role": "assistant", "content": "R!"}, nxt[3]]) is None
    assert tree.extended_turn([sys, {"role": "user", "content": "summary"}]) is None


def test_a_reply_the_harness_asked_again_for_is_abandoned_and_never_trained():
    tree = SessionTree("s")
    first = _turn(tree, [1, 2, 3], [10, 11])  # a client timeout: the harness never saw this reply
    retry = _turn(tree, [1, 2, 3], [12, 13])  # the same messages again
    assert first.abandoned and not retry.abandoned
    follow = _turn(tree, [1, 2, 3, 12, 13, 4], [14], messages=[*retry.messages, {"role": "assistant", "content": "r"}])
    segs = segments(tree)
    assert [s.tokens for s in segs] == [[1, 2, 3, 12, 13, 4, 14]] and segs[0].loss_mask == [0, 0, 0, 1, 1, 0, 1]
    assert segs[0].turns == [retry.index, follow.index]
    assert tree.stats()["abandoned_turns"] == 1.0


def test_a_continued_reply_stays_used_when_its_messages_are_asked_again():
    tree = SessionTree("s")
    a = _turn(tree, [1, 2], [10], reply="x")
    _turn(tree, [1, 2, 10, 3], [11], messages=[*a.messages, {"role": "assistant", "content": "x"}, {"role": "user"}])
    again = _turn(tree, [1, 2], [12])  # a sub-agent asking the same first question: its own branch, both used
    assert not a.abandoned and not again.abandoned
    assert sorted(s.tokens for s in segments(tree)) == [[1, 2, 10, 3, 11], [1, 2, 12]]


def test_a_reply_the_harness_hung_up_on_is_not_trained_nor_counted_as_truncated():
    tree = SessionTree("s")
    cut = _turn(tree, [1, 2], [10, 11], truncated=True)
    tree.abandon(cut)
    assert segments(tree) == [] and tree.stats()["truncated_turns"] == 0.0


def test_a_hang_up_on_the_last_request_keeps_the_turns_before_it():
    tree = SessionTree("s")
    a = _turn(tree, [1, 2], [10, 11], reply="x")
    last = _turn(tree, [1, 2, 10, 11, 3], [12], messages=[*a.messages, {"role": "assistant", "content": "x"}, {}])
    tree.abandon(last)  # the agent timed out on its final call
    [seg] = segments(tree)
    assert seg.tokens == [1, 2, 10, 11] and seg.loss_mask == [0, 0, 1, 1] and seg.turns == [a.index]


def test_messages_asked_again_after_other_requests_are_no_retry():
    tree = SessionTree("s")
    first = _turn(tree, [1, 2], [10])  # a harness that re-sends a state prompt between other requests
    _turn(tree, [5, 6], [11])
    again = _turn(tree, [1, 2], [12])
    assert not first.abandoned and not again.abandoned
    assert sorted(s.tokens for s in segments(tree)) == [[1, 2, 10], [1, 2, 12], [5, 6, 11]]
