import pytest

from grpoflow.rollout.agents.shell import format_output, parse_command, says_done
from grpoflow.tokens import TemplateError, TokenTrajectory, load_tokenizer


@pytest.mark.parametrize(
    "reply, command",
    [
        ("```bash\necho hi > /app/x\n```", "echo hi > /app/x"),
        ("Sure:\n```sh\nls\n```\nthen DONE", "ls"),
        ("```\nmkdir /app/out\n```", "mkdir /app/out"),
        ("no fence here: echo hi", None),
        ("```bash\n\n```", None),
        ("```bash\necho half", "echo half"),  # an unclosed fence still counts (the turn was not cut)
    ],
)
def test_parse_command(reply, command):
    assert parse_command(reply) == command


@pytest.mark.parametrize(
    "reply, done",
    [
        ("DONE", True),
        ("Sure:\n```sh\nls\n```\nthen DONE", True),
        ('```bash\necho "DONE" > /app/x\n```', False),  # a word the command writes
        ("```bash\necho DONE", False),  # in an unclosed fence too
        ("```bash\nls\n```", False),
    ],
)
def test_only_a_done_outside_the_commands_ends_the_episode(reply, done):
    assert says_done(reply) is done


def test_output_is_capped_keeping_head_and_tail():
    out = format_output("a" * 500 + "END", "", 3, cap=100)
    assert out.startswith("exit code 3\naaaa") and out.endswith("END") and "characters cut" in out
    assert len(out) < 200


def test_trajectory_is_token_exact_and_masks_only_generated_tokens(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    traj = TokenTrajectory.start(tok, [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    n0 = len(traj.tokens)
    # Deliberately odd ids a re-tokenisation would never produce: they must survive verbatim.
    gen = [5, 5, 7, tok.eos_token_id]
    traj.add_generated(gen, [-1.0, -2.0, -3.0, -0.5])
    added = traj.add_user("exit code 0")
    assert traj.tokens[n0 : n0 + 4] == gen
    assert traj.loss_mask == [0] * n0 + [1] * 4 + [0] * added
    assert traj.logprobs[n0 : n0 + 4] == [-1.0, -2.0, -3.0, -0.5] and set(traj.logprobs[n0 + 4 :]) == {0.0}
    tail = tok.decode(traj.tokens[n0 + 4 :])
    assert tail == "\n<|im_start|>user\nexit code 0<|im_end|>\n<|im_start|>assistant\n"


def test_turn_without_eos_is_closed_by_a_template_token(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    traj = TokenTrajectory.start(tok, [{"role": "user", "content": "u"}])
    n0 = len(traj.tokens)
    traj.add_generated([9, 9], [-1.0, -1.0])
    traj.add_user("out")
    assert traj.tokens[n0 + 2] == tok.eos_token_id and traj.loss_mask[n0 + 2] == 0


def test_template_without_eos_closing_is_refused(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    traj = TokenTrajectory.start(tok, [{"role": "user", "content": "u"}])
    traj.add_generated([9], [-1.0])
    with pytest.raises(TemplateError):
        traj.add_user("out")
