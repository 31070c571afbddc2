"""The chat template decides where a turn ends: exact-token multi-turn works whatever the tokenizer's EOS, and a
template that cannot be extended token-exactly fails at prepare, naming the model dir."""

import json
import shutil

import pytest
from transformers import AutoTokenizer

from grpoflow.errors import ModelError
from grpoflow.prepare.model import prepare_model
from grpoflow.tokens import TokenTrajectory, is_cut_off, stop_ids, turn_end


def _base_layout(tiny_model_dir):
    """The tiny ChatML tokenizer as a base model ships it (Qwen2.5 base): EOS `<|endoftext|>`, turns still closed
    with `<|im_end|>`."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.eos_token = "<|endoftext|>"
    return tok


def test_a_turn_end_that_is_not_the_eos_still_extends_the_chat_token_exactly(tiny_model_dir):
    tok = _base_layout(tiny_model_dir)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert turn_end(tok) == ("<|im_end|>", im_end) and im_end != tok.eos_token_id
    traj = TokenTrajectory.start(tok, [{"role": "user", "content": "list files"}])
    reply = tok.encode("ls", add_special_tokens=False) + [im_end]
    traj.add_generated(reply, [-0.5] * len(reply))
    traj.add_user("a.txt")  # raised TemplateError when the turn end was taken to be the EOS
    rendered = tok.apply_chat_template(traj.messages, add_generation_prompt=True, tokenize=False)
    assert traj.tokens == tok.encode(rendered, add_special_tokens=False)
    assert traj.loss_mask[traj.prompt_len : traj.prompt_len + len(reply)] == [1] * len(reply)


def test_a_turn_ended_by_either_stop_token_was_not_cut_off(tiny_model_dir):
    tok = _base_layout(tiny_model_dir)
    stop = stop_ids(tok)
    assert stop == {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}
    for last in stop:
        assert not is_cut_off("length", [5, last], stop)
    assert is_cut_off("length", [5, 6], stop) and not is_cut_off("stop", [5, 6], stop)


def test_a_template_that_does_not_close_turns_with_a_special_token_fails_at_prepare(tiny_model_dir, tmp_path):
    bad = tmp_path / "model"
    shutil.copytree(tiny_model_dir, bad)
    (bad / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    config = bad / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}))
    with pytest.raises(ModelError, match=rf"model dir {bad}: the chat template does not close assistant turns"):
        prepare_model(str(bad))


def test_a_template_that_rewrites_earlier_turns_is_refused_for_the_shell_agent_only(tiny_model_dir, tmp_path):
    from grpoflow.config import parse_run_config
    from grpoflow.prepare.dataset import load_dataset
    from grpoflow.run.start import make_prompts, record_run

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    # ChatML that shows an earlier assistant turn as "..." once a new message follows (as Qwen3 drops thinking)
    (model_dir / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    config = model_dir / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}))
    model = prepare_model(str(model_dir))  # it closes turns with <|im_end|>: fine for the session server
    dataset = load_dataset("builtin-fixed")
    for harness, refused in (("shell", True), ("terminus-2", False)):
        cfg = parse_run_config(
            {"run_id": harness, "output_dir": str(tmp_path / "runs"), "rollout": {"harness": {"name": harness}}}
        )
        if refused:
            with pytest.raises(ModelError, match=r"renders earlier turns differently.*the shell agent cannot keep"):
                record_run(cfg, model, dataset, make_prompts(cfg, dataset))
            assert not (tmp_path / "runs" / harness).exists()  # refused before anything was written
        else:
            assert record_run(cfg, model, dataset, make_prompts(cfg, dataset)).paths.root.is_dir()


def test_every_eos_of_the_generation_config_ends_a_turn(tiny_model_dir, tmp_path):
    """A model whose generation_config.json lists EOS ids beside the tokenizer's (Llama-3.1 ends a tool-call turn
    with `<|eom_id|>`): a turn that ends on one ended by itself, it was not cut off."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tok = AutoTokenizer.from_pretrained(model)
    extra = 7
    assert extra not in stop_ids(tok)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, extra]}))
    tok = AutoTokenizer.from_pretrained(model)
    assert extra in stop_ids(tok) and tok.eos_token_id in stop_ids(tok)
    assert not is_cut_off("length", [5, extra], stop_ids(tok))  # ended on it, at the limit too
    (model / "generation_config.json").write_text("{not json")
    assert extra not in stop_ids(AutoTokenizer.from_pretrained(model))  # unreadable: the template's stops remain
