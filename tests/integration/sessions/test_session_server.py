"""The session server over a scripted SGLang `/generate`: token exactness, compaction segments, truncation,
OpenAI's shape through the real `openai` client, concurrency, seeds and limits."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import openai
import pytest

from grpoflow.config import TrainConfig
from grpoflow.rollout.sessions.segments import segment_samples
from grpoflow.samples import Sample
from grpoflow.seeds import turn_seed
from grpoflow.train.step import prepare_samples
from tests.integration.sessions.conftest import Out

SYS = {"role": "system", "content": "You are a shell agent."}


def _client(server, sid, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.session_url(sid, **kw), api_key=server.session_token(sid), max_retries=0)


def _chat(client, messages, **kw):
    return client.chat.completions.create(model="policy", messages=messages, max_tokens=32, **kw)


def _noncanonical(tok, text: str) -> list[int]:
    """`text` as one token per character: the same text, but ids the tokenizer itself would never produce."""
    ids = [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]
    assert tok.decode(ids) == text and ids != tok.encode(text, add_special_tokens=False)
    return ids


def _trial(rollout_id="g-0", group="g", reward=1.0, index=0) -> Sample:
    return Sample(
        run_id="r",
        step=0,
        instance_id="task",
        group_id=group,
        sample_index=index,
        rollout_id=rollout_id,
        tokens=[],
        loss_mask=[],
        rollout_logprobs=[],
        prompt_len=0,
        reward=reward,
        status="COMPLETED",
        exit_status="Submitted",
        metrics={"turns": 3.0},
    )


def test_recorded_ids_are_trained_when_retokenising_the_history_differs(scripted, tok):
    """(a) The engine's ids for "hello world" are one token per character; the harness sends the text back.
    Re-tokenising the history would give the merged ids: the session keeps and trains the engine's ids."""
    gen1 = _noncanonical(tok, "echo hello world") + [tok.eos_token_id]
    gen2 = tok.encode("ls -la", add_special_tokens=False) + [tok.eos_token_id]
    engine, server = scripted(lambda ids, i: Out(gen1 if i == 0 else gen2))
    client = _client(server, "step0-task-0")
    m1 = [SYS, {"role": "user", "content": "say hello"}]
    r1 = _chat(client, m1)
    assert r1.choices[0].message.content == "echo hello world"
    m2 = m1 + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "exit code 0\nhello world"},
    ]
    _chat(client, m2)

    first, second = engine.calls[0].input_ids, engine.calls[1].input_ids
    assert second[: len(first) + len(gen1)] == first + gen1  # the exact ids reach the engine on the next turn
    retokenised = tok.encode(
        tok.apply_chat_template(m2, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    assert retokenised != second

    tree = server.pop_session("step0-task-0")
    assert [t.retokenize_mismatch for t in tree.turns] == [False, True]
    assert tree.turns[1].extends == 0 and tree.turns[1].first_mismatch == len(first)
    assert tree.mismatch_rate == 0.5
    totals = server.stats()
    assert totals["requests"] == 2 and totals["retokenize_mismatches"] == 1
    assert totals["retokenize_mismatch_rate"] == 0.5

    [sample] = segment_samples(_trial(), tree)
    assert sample.tokens == second + gen2
    trained = [t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if m]
    assert trained == gen1 + gen2  # the recorded ids, not the re-tokenisation
    assert [lp for lp, m in zip(sample.rollout_logprobs, sample.loss_mask, strict=True) if m] == pytest.approx(
        [-0.1 * (i + 1) for i in range(len(gen1))] + [-0.1 * (i + 1) for i in range(len(gen2))]
    )
    assert sample.metrics["retokenize_mismatches"] == 1 and sample.prompt_len == len(first)


def test_compaction_yields_segments_of_one_rollout_trained_once(scripted, tok):
    """(b) Two main turns; then, as terminus-2 does when the context runs full, a summary request on the history
    unwound to the first turn (a branch that shares turn 0's generated tokens), then a fresh context that carries
    the summary (a branch at the system prompt)."""
    eos = tok.eos_token_id
    replies = ["ls", "cat notes.txt", "I listed files and read notes.", "wc -l notes.txt"]
    outs = [tok.encode(r, add_special_tokens=False) + [eos] for r in replies]
    engine, server = scripted(lambda ids, i: Out(outs[i]))
    client = _client(server, "step0-task-1")
    task = {"role": "user", "content": "count the lines of notes.txt"}
    h1 = [SYS, task]
    a1 = {"role": "assistant", "content": _chat(client, h1).choices[0].message.content}
    h2 = h1 + [a1, {"role": "user", "content": "exit code 0\nnotes.txt"}]
    _chat(client, h2)
    summary = _chat(client, h1 + [a1, {"role": "user", "content": "Summarise your work so far."}])
    fresh = [SYS, {"role": "user", "content": f"Task: count lines. Summary: {summary.choices[0].message.content}"}]
    _chat(client, fresh)

    tree = server.pop_session("step0-task-1")
    assert [t.extends for t in tree.turns] == [None, 0, 0, None]
    assert not any(t.retokenize_mismatch for t in tree.turns)
    main = _trial("step0-task-1", reward=1.0, index=0)
    samples = segment_samples(main, tree)
    assert len(samples) == 3
    assert {s.rollout_id for s in samples} == {"step0-task-1"}
    assert {(s.reward, s.status, s.exit_status) for s in samples} == {(1.0, "COMPLETED", "Submitted")}
    assert [s.segment_index for s in samples] == list(range(3))
    assert {s.tokens[-len(o) :] == o for s, o in zip(samples, [outs[1], outs[2], outs[3]])} == {True}
    # turn 0's output is in the main and the summary segment, trained in exactly one of them
    start = len(engine.calls[0].input_ids)
    holders = [s for s in samples if s.tokens[: start + len(outs[0])] == engine.calls[0].input_ids + outs[0]]
    assert len(holders) == 2
    assert sorted(sum(s.loss_mask[start : start + len(outs[0])]) for s in holders) == [0, len(outs[0])]
    # every token the policy generated is trained exactly once across the segments
    assert sum(sum(s.loss_mask) for s in samples) == sum(len(o) for o in outs)

    # one GRPO slot: this rollout (reward 1, 3 segments) against one other rollout (reward 0, 1 segment)
    other = _trial("step0-task-other", reward=0.0, index=1).model_copy(
        update={"tokens": [1, 2, 3], "loss_mask": [0, 1, 1], "rollout_logprobs": [0.0, -1.0, -1.0]}
    )
    kept, adv, counts = prepare_samples(samples + [other], TrainConfig())
    by_rollout = {s.rollout_id: [] for s in kept}
    for s, a in zip(kept, adv.tolist(), strict=True):
        by_rollout[s.rollout_id].append(a)
    # population std over the 2 rollouts: +1 and -1 (counted per segment it would be 0.58 and -1.73)
    assert by_rollout == {
        "step0-task-1": pytest.approx([1.0] * 3, abs=1e-5),
        "step0-task-other": pytest.approx([-1.0], abs=1e-5),
    }
    assert counts["n_groups"] == 1


def test_a_request_continuing_a_truncated_turn_is_refused(scripted, tok):
    """(c) After a `length` finish the path is closed: continuing it gets 400, the engine is not called."""
    cut = tok.encode("echo half a comm", add_special_tokens=False)  # no EOS: cut off at the limit
    engine, server = scripted(lambda ids, i: Out(cut, finish="length") if i == 0 else Out([5, tok.eos_token_id]))
    client = _client(server, "step0-task-2")
    h1 = [SYS, {"role": "user", "content": "do it"}]
    r1 = _chat(client, h1)
    assert r1.choices[0].finish_reason == "length"
    cont = h1 + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "Your reply was truncated; continue."},
    ]
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, cont)
    body = err.value.body
    assert err.value.status_code == 400 and body["code"] == "session_path_closed"
    assert "cut off" in body["message"] and "turn 0" in body["message"]
    assert len(engine.calls) == 1
    # the recorded truncated turn is intact and its sample is trainable; a fresh context still works
    _chat(client, [SYS, {"role": "user", "content": "start over"}])
    tree = server.pop_session("step0-task-2")
    assert tree.refused == 1 and tree.turns[0].truncated
    samples = segment_samples(_trial("step0-task-2"), tree)
    first = samples[0]
    assert first.tokens[-len(cut) :] == cut and first.loss_mask[-len(cut) :] == [1] * len(cut)
    # the trial is TRUNCATED in every segment, its reward kept
    assert {(s.status, s.exit_status, s.reward) for s in samples} == {("TRUNCATED", "SequenceLengthLimitExceeded", 1.0)}


def test_length_finish_that_ended_with_eos_is_not_a_truncation(scripted, tok):
    out = tok.encode("ls", add_special_tokens=False) + [tok.eos_token_id]
    _, server = scripted(lambda ids, i: Out(out, finish="length"))
    r = _chat(_client(server, "s"), [SYS, {"role": "user", "content": "x"}])
    assert r.choices[0].finish_reason == "stop"
    assert not server.pop_session("s").turns[0].truncated


def test_openai_shape_logprobs_and_token_ids(scripted, tok):
    """(d) content, finish_reason, usage, logprobs and token ids, read by the real openai client."""
    out = tok.encode("ls -la", add_special_tokens=False) + [tok.eos_token_id]
    engine, server = scripted(lambda ids, i: Out(out, logprobs=[-0.5] * len(out)))
    client = _client(server, "shape")
    r = _chat(
        client,
        [SYS, {"role": "user", "content": "list"}],
        logprobs=True,
        extra_body={"return_token_ids": True, "session_id": "harbor-extra"},
    )
    prompt = engine.calls[0].input_ids
    assert r.object == "chat.completion" and r.model == "policy"
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == "ls -la" and c.finish_reason == "stop"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(prompt),
        len(out),
        len(prompt) + len(out),
    )
    assert [x.logprob for x in c.logprobs.content] == [-0.5] * len(out)
    assert "".join(x.token for x in c.logprobs.content[:-1]) == "ls -la"
    assert c.model_extra["token_ids"] == out and r.model_extra["prompt_token_ids"] == prompt
    # without the flags: no logprobs, no ids
    r2 = _chat(_client(server, "shape2"), [SYS, {"role": "user", "content": "list"}])
    assert r2.choices[0].logprobs is None and "token_ids" not in (r2.choices[0].model_extra or {})
    # a rollout id with a `/` (a task name) travels percent-encoded
    _chat(_client(server, "step0-org/task:v2-3"), [SYS, {"role": "user", "content": "list"}])
    assert server.pop_session("step0-org/task:v2-3").turns[0].reply == "ls -la"
    models = client.models.list()
    assert [m.id for m in models.data] == ["policy"]
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "policy"


def test_litellm_hosted_vllm_passes_token_ids_as_harbor_reads_them(scripted, tok):
    """Harbor's LiteLLM wrapper reads `provider_specific_fields["token_ids"]` and `response.prompt_token_ids`."""
    import litellm

    out = tok.encode("pwd", add_special_tokens=False) + [tok.eos_token_id]
    engine, server = scripted(lambda ids, i: Out(out))
    resp = litellm.completion(
        model="hosted_vllm/policy",
        api_base=server.session_url("lite"),
        api_key=server.session_token("lite"),
        messages=[SYS, {"role": "user", "content": "where am I"}],
        max_tokens=16,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    choice = resp.choices[0]
    assert choice.message.content == "pwd" and choice.finish_reason == "stop"
    assert choice.provider_specific_fields["token_ids"] == out
    assert resp.prompt_token_ids == engine.calls[0].input_ids
    want = [-0.1 * (i + 1) for i in range(len(out))]
    assert [x["logprob"] for x in choice.logprobs["content"]] == pytest.approx(want)


def test_sessions_run_concurrently_and_the_key_is_never_logged(scripted, tok, caplog):
    eos = tok.eos_token_id

    def script(ids, i):
        return Out(tok.encode(f"echo {len(ids)}", add_special_tokens=False) + [eos])

    engine, server = scripted(script)
    caplog.set_level(logging.DEBUG)

    async def trial(k: int) -> None:
        sid = f"trial-{k}"
        client = openai.AsyncOpenAI(base_url=server.session_url(sid), api_key=server.session_token(sid), max_retries=0)
        msgs = [SYS, {"role": "user", "content": f"task {k}"}]
        for turn in range(3):
            r = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=8)
            msgs = msgs + [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": f"out {k}.{turn}"},
            ]
        await client.close()

    async def main():
        await asyncio.gather(*(trial(k) for k in range(8)))

    asyncio.run(main())
    for k in range(8):
        tree = server.pop_session(f"trial-{k}")
        assert [t.extends for t in tree.turns] == [None, 0, 1]
        assert all(f"task {k}" in t.messages[1]["content"] for t in tree.turns)
    assert server.stats()["requests"] == 24 and server.stats()["sessions"] == 8
    assert not any(server.session_token(f"trial-{k}") in caplog.text for k in range(8))
    # an unknown session was never seen: an empty tree, which still gives the rollout its one (empty) sample
    [empty] = segment_samples(_trial("never"), server.pop_session("never"))
    assert empty.tokens == [] and empty.reward == 1.0


def test_seed_cap_and_context_limit(scripted, tok):
    engine, server = scripted(
        lambda ids, i: Out([7, tok.eos_token_id]),
        sampling={"max_new_tokens": 16, "temperature": 0.7, "top_p": 0.9},
        episode={"max_context_tokens": 64},
    )
    client = _client(server, "seeded", seed=100)
    h = [SYS, {"role": "user", "content": "x"}]
    r = client.chat.completions.create(model="policy", messages=h, max_tokens=500, temperature=0.7, top_p=0.9)
    h2 = h + [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "y"}]
    client.chat.completions.create(model="policy", messages=h2, max_tokens=4, seed=5)
    p0, p1 = engine.calls[0].sampling_params, engine.calls[1].sampling_params
    assert (p0.sampling_seed, p0.max_new_tokens, p0.temperature, p0.top_p) == (turn_seed(100, 0), 16, 0.7, 0.9)
    # The trial's seed wins over the request's: terminus-2 sends one `seed` on every call, which would replay one
    # noise stream on every turn.
    assert (p1.sampling_seed, p1.max_new_tokens) == (turn_seed(100, 1), 4)
    assert p0.sampling_seed != p1.sampling_seed
    long = [SYS, {"role": "user", "content": "word " * 200}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="policy", messages=long, max_tokens=4)
    assert err.value.body["code"] == "context_length_exceeded" and "maximum context length is 64" in str(err.value)
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.chat.completions.create(model="policy", messages=h, n=2)
    assert len(engine.calls) == 2


def test_runner_works_from_async_code(tiny_model_dir, tok):
    from grpoflow.rollout.sessions.server import SessionServer
    from tests.fakes.session_settings import session_settings
    from tests.integration.sessions.conftest import ScriptedEngine

    engine = ScriptedEngine(str(tiny_model_dir), lambda ids, i: Out([9, tok.eos_token_id]))

    async def main() -> SessionServer:
        async with SessionServer(
            session_settings(engine.url, str(tiny_model_dir), episode={"max_context_tokens": 512})
        ) as srv:
            client = openai.AsyncOpenAI(
                base_url=srv.session_url("a-1"), api_key=srv.session_token("a-1"), max_retries=0
            )
            r = await client.chat.completions.create(model="policy", messages=[SYS], max_tokens=4)
            await client.close()
            assert r.choices[0].finish_reason == "stop"
            assert len(srv.pop_session("a-1").turns) == 1
        return srv

    try:
        srv = asyncio.run(main())
    finally:
        engine.stop()
    with pytest.raises(httpx.ConnectError):  # stopped on leaving the block
        httpx.get(srv.url + "/health", timeout=2)


def test_the_run_pins_sampling_whatever_the_harness_sends_and_each_turn_records_it(scripted, tok):
    pinned = {"temperature": 0.6, "top_p": 1.0, "top_k": -1}
    engine, server = scripted(lambda ids, i: Out([7, tok.eos_token_id]), sampling=pinned)
    client = _client(server, "pinned", seed=3)
    h = [SYS, {"role": "user", "content": "x"}]
    _chat(client, h, temperature=1.3, top_p=0.5, extra_body={"top_k": 20})
    p = engine.calls[0].sampling_params
    assert (p.temperature, p.top_p, p.top_k, p.sampling_seed) == (0.6, 1.0, -1, turn_seed(3, 0))
    tree = server.pop_session("pinned")
    assert tree.turns[0].sampling == {"temperature": 0.6, "top_p": 1.0, "top_k": -1, "sampling_seed": turn_seed(3, 0)}


def test_turn_seeds_of_neighbouring_trials_do_not_collide():
    # a group's trial seeds are neighbours: `seed + turn` gave trial k's second turn trial k+1's first seed
    seeds = {turn_seed(trial, turn) for trial in range(1000, 1016) for turn in range(8)}
    assert len(seeds) == 16 * 8


def test_replies_the_harness_never_used_are_not_trained(scripted, tok):
    """A client that times out and retries (the OpenAI client's own retry) sends the same messages twice; the
    first reply reached no one. Only the reply the harness went on with trains."""
    eos = tok.eos_token_id
    slow, used, follow = (tok.encode(t, add_special_tokens=False) + [eos] for t in ("ls /", "ls /app", "cat a"))

    def script(ids, i):
        if i == 0:
            time.sleep(1.5)  # past the client's timeout: it hangs up and asks again
        return Out([slow, used, follow][i])

    engine, server = scripted(script)
    client = openai.OpenAI(
        base_url=server.session_url("t-0"), api_key=server.session_token("t-0"), max_retries=1, timeout=1.0
    )
    m1 = [SYS, {"role": "user", "content": "list the files"}]
    r1 = _chat(client, m1)
    assert r1.choices[0].message.content == "ls /app"
    _chat(client, [*m1, {"role": "assistant", "content": "ls /app"}, {"role": "user", "content": "a b"}])
    tree = server.pop_session("t-0")
    assert [t.abandoned for t in tree.turns] == [True, False, False]
    [sample] = segment_samples(_trial("t-0"), tree)
    trained = [t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if m]
    assert trained == used + follow and sample.metrics["abandoned_turns"] == 1.0


def test_a_reply_after_the_harness_hung_up_is_not_trained(scripted, tok):
    eos = tok.eos_token_id

    def script(ids, i):
        time.sleep(1.0)
        return Out(tok.encode("echo late", add_special_tokens=False) + [eos])

    engine, server = scripted(script)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            server.session_url("t-1") + "/chat/completions",
            json={"model": "policy", "messages": [SYS, {"role": "user", "content": "hi"}], "max_tokens": 8},
            headers={"Authorization": f"Bearer {server.session_token('t-1')}"},
            timeout=0.3,
        )
    turns, deadline = server.store.get("t-1").tree.turns, time.monotonic() + 10
    while not (turns and turns[0].abandoned) and time.monotonic() < deadline:  # the engine is still answering
        time.sleep(0.05)
    tree = server.pop_session("t-1")
    assert len(tree.turns) == 1 and tree.turns[0].abandoned
    [sample] = segment_samples(_trial("t-1"), tree)
    assert sum(sample.loss_mask) == 0


def test_a_request_for_an_ended_session_is_refused_not_opened_again(scripted, tok):
    """A harness still running after its trial ended (a lost worker's sandbox) gets 410 and leaves no session
    behind: its turns would otherwise train, and the session would live for the rest of the run."""
    engine, server = scripted(lambda ids, i: Out(tok.encode("ls", add_special_tokens=False) + [tok.eos_token_id]))
    url, token = server.session_url("late-0"), server.session_token("late-0")
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    headers = {"Authorization": f"Bearer {token}"}
    assert httpx.post(f"{url}/chat/completions", json=body, headers=headers).status_code == 200
    assert len(server.pop_session("late-0").turns) == 1
    late = httpx.post(f"{url}/chat/completions", json=body, headers=headers)
    assert late.status_code == 410 and late.json()["error"]["code"] == "session_closed"
    assert "late-0" not in server.store.sessions and len(engine.calls) == 1
    with pytest.raises(ValueError, match="has ended"):
        server.session_url("late-0", seed=1)


def test_each_attempt_of_a_trial_gets_a_session_and_token_of_its_own(tiny_model_dir, tmp_path):
    """`policy_access` for a harness behind the session server: a retried trial's second attempt talks to
    another session with another token, and the first attempt's session is closed by `forget`."""
    from grpoflow.config import parse_run_config
    from grpoflow.rollout.policy import policy_access
    from grpoflow.rollout.trials import TrialSpec
    from tests.fakes.scripted_engine import ScriptedEngine

    cfg = parse_run_config({"rollout": {"harness": {"name": "terminus-2"}}})
    engine = ScriptedEngine(str(tiny_model_dir), lambda ids, i: Out([tok_id for tok_id in ids[:1]]))
    spec = TrialSpec("task", "/tasks/task", "g", 0, "g-0", 7)

    async def attempts():
        async with policy_access(cfg.rollout, cfg.engine, engine.url, str(tiny_model_dir)) as policy:
            first = policy.make_agent(spec)
            policy.forget(spec)  # the first attempt failed in its sandbox: it is run again
            second = policy.make_agent(spec)
            return first, second

    first, second = asyncio.run(attempts())
    assert first.kwargs["api_base"] != second.kwargs["api_base"]
    assert first.kwargs["api_base"].endswith("/sessions/g-0.0/v1") and second.kwargs["api_base"].endswith("g-0.1/v1")
    keys = [a.env["GRPOFLOW_SESSION_TOKEN"] for a in (first, second)]
    assert keys[0] != keys[1]
