"""The session server over the real embedded engine (tiny model): a multi-turn session through the `openai`
client whose training sample the model itself scores exactly as the engine did, so every token of it is what the
engine saw and produced."""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from grpoflow.rollout.sessions.segments import segment_samples
from grpoflow.rollout.sessions.server import SessionServer
from grpoflow.samples import Sample
from tests.fakes.session_settings import session_settings

# The trainer's view below scores tokens under softmax(logits): the run samples at temperature 1.
TURN = {"max_new_tokens": 12, "temperature": 1.0}


def test_multi_turn_session_trains_exactly_what_the_engine_generated(embedded_engine_url, tiny_model_dir, tok):
    # A random model rarely says EOS: stop at any id of the upper half of the vocabulary, so turns end "stop"
    stop_ids = list(range(512, len(tok)))
    with SessionServer(session_settings(embedded_engine_url, str(tiny_model_dir), sampling=TURN)) as server:
        client = openai.OpenAI(
            base_url=server.session_url("emb-0", seed=11), api_key=server.session_token("emb-0"), max_retries=0
        )
        msgs = [
            {"role": "system", "content": "You reply with one bash command."},
            {"role": "user", "content": "List the files."},
        ]
        replies = []
        for turn in range(3):
            r = client.chat.completions.create(
                model="tiny",
                messages=msgs,
                max_tokens=12,
                logprobs=True,
                extra_body={"return_token_ids": True, "stop_token_ids": stop_ids},
            )
            c = r.choices[0]
            assert c.finish_reason == "stop" and c.model_extra["token_ids"][-1] in stop_ids
            assert len(c.logprobs.content) == len(c.model_extra["token_ids"]) == r.usage.completion_tokens
            assert r.usage.prompt_tokens == len(r.model_extra["prompt_token_ids"])
            replies.append(r)
            msgs = msgs + [
                {"role": "assistant", "content": c.message.content},
                {"role": "user", "content": f"exit code 0\nfile{turn}.txt"},
            ]
        tree = server.pop_session("emb-0")
        totals = server.stats()

    assert [t.extends for t in tree.turns] == [None, 0, 1]
    # each turn's prompt is the previous prompt + the previous output ids, verbatim
    for prev, cur in zip(replies, replies[1:], strict=False):
        head = prev.model_extra["prompt_token_ids"] + prev.choices[0].model_extra["token_ids"]
        assert cur.model_extra["prompt_token_ids"][: len(head)] == head
    assert totals["requests"] == 3 and 0.0 <= totals["retokenize_mismatch_rate"] <= 1.0

    trial = Sample(
        run_id="r",
        step=0,
        instance_id="t",
        group_id="g",
        sample_index=0,
        rollout_id="emb-0",
        tokens=[],
        loss_mask=[],
        rollout_logprobs=[],
        prompt_len=0,
        reward=0.0,
        status="COMPLETED",
        exit_status="Submitted",
    )
    [sample] = segment_samples(trial, tree)
    last = replies[-1]
    assert sample.tokens == last.model_extra["prompt_token_ids"] + last.choices[0].model_extra["token_ids"]
    want_generated = [i for r in replies for i in r.choices[0].model_extra["token_ids"]]
    assert [t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if m] == want_generated

    # the trainer's view: one forward over the sample scores each generated token as the engine did
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([sample.tokens])).logits[0].float()  # (T, V)
    lp = torch.log_softmax(logits, -1)
    pos = [i for i, m in enumerate(sample.loss_mask) if m]
    ours = [lp[i - 1, sample.tokens[i]].item() for i in pos]
    engine = [sample.rollout_logprobs[i] for i in pos]
    assert ours == pytest.approx(engine, abs=2e-3)
    assert engine == pytest.approx([x.logprob for r in replies for x in r.choices[0].logprobs.content])
