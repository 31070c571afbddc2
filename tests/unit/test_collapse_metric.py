"""The step's first-command spread: a policy that answers every task with the same program shows it as a share
near 1 and an entropy near 0, whatever its rewards; a compacted trial's segments count once."""

import math

import pytest

from grpoflow.rollout.metrics import first_command, step_metrics
from grpoflow.run.metrics import plot_curves
from grpoflow.samples import Sample


def _trial(rollout: str, reply: str | None, segment: int = 0) -> Sample:
    messages = [{"role": "system", "content": "run commands"}, {"role": "user", "content": "do it"}]
    if reply is not None:
        messages.append({"role": "assistant", "content": reply})
    return Sample(
        run_id="r",
        step=0,
        instance_id=rollout.split("-")[0],
        group_id=f"g-{rollout.split('-')[0]}",
        sample_index=0,
        rollout_id=rollout,
        segment_index=segment,
        tokens=[1, 2],
        loss_mask=[0, 1],
        rollout_logprobs=[0.0, -1.0],
        prompt_len=1,
        reward=1.0,
        status="COMPLETED",
        exit_status="Submitted",
        messages=messages,
    )


@pytest.mark.parametrize(
    ("reply", "command"),
    [
        ("```bash\necho hi > /app/x\n```", "echo"),
        ("I will make it.\n```sh\n\n  mkdir -p /app/d && ls\n```\n", "mkdir"),
        ("cp a b", "cp"),
        ("```bash\n", None),
        ("", None),
    ],
)
def test_the_first_command_is_the_first_word_of_the_first_block(reply, command):
    assert first_command(_trial("t-0", reply)) == command


def test_a_collapsed_step_has_one_command_and_no_entropy():
    collapsed = [_trial(f"t{i}-0", f"```bash\necho {i} > /app/f{i}\n```") for i in range(4)]
    m = step_metrics(collapsed, 1.0).computed
    assert m["first_command_top_share"] == 1.0 and m["first_command_entropy"] == 0.0
    varied = [_trial(f"t{i}-0", f"```bash\n{c} /app/x\n```") for i, c in enumerate(["echo", "mkdir", "rm", "echo"])]
    m = step_metrics(varied, 1.0).computed
    assert m["first_command_top_share"] == 0.5
    assert m["first_command_entropy"] == pytest.approx(-(0.5 * math.log2(0.5) + 2 * 0.25 * math.log2(0.25)))
    # a compacted trial's later segment repeats the conversation: the trial counts once
    again = step_metrics([*varied, _trial("t0-0", "```bash\nmkdir x\n```", segment=1)], 1.0).computed
    assert again["first_command_top_share"] == 0.5


def test_trials_with_no_reply_add_no_spread_and_the_plot_draws_it(tmp_path):
    assert "first_command_entropy" not in step_metrics([_trial("t-0", None)], 1.0).computed
    rows = [{"step": s, "rollout/reward_mean": 0.5, "rollout/first_command_top_share": 0.5 + s / 8} for s in range(4)]
    assert plot_curves(rows, tmp_path / "summary.png").stat().st_size > 0
