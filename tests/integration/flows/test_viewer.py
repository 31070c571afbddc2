"""The trajectory viewer (`viewer.html`): after a train run, the best and the worst trial of every group per
step, with where a turn was cut off, readable offline; rendered in headless Chromium, screenshot in
test-output/viewer/."""

import html
import shutil
from pathlib import Path

import pytest

from flows.train import train_flow
from grpoflow.config import parse_run_config
from grpoflow.paths import RunPaths
from grpoflow.rollout.journal import read_samples
from grpoflow.run.viewer import best_and_worst
from tests.integration.faults.policy import fence_policy, reward_tasks, run_config
from tests.system.deployments.browser import Browser, chromium_path

pytestmark = [pytest.mark.flow, pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")]
OUTPUT = Path(__file__).resolve().parents[3] / "test-output" / "viewer"  # screenshots a person looks at


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("viewer")
    model = fence_policy(tiny_model_dir, tmp / "policy")
    cfg = run_config(tmp / "runs", model, reward_tasks(tmp / "tasks"), "viewed", steps=2, evals=1)
    cfg["rollout"]["sampling"]["max_new_tokens"] = 10  # some replies run longer: cut-off turns
    train_flow(parse_run_config(cfg))
    return tmp / "runs" / "viewed"


def test_the_viewer_shows_the_best_and_worst_trial_of_every_group(run_dir):
    page = RunPaths(run_dir).viewer.read_text()
    assert "<script" not in page and "http" not in page  # offline: nothing to fetch, nothing to run
    for details in ("step_0", "step_1", "eval_0", "eval_2"):
        assert f"id='{details}'" in page, details
        for trials in _groups(run_dir / "details" / details).values():
            best, worst = best_and_worst(trials)
            assert html.escape(best.rollout_id) in page and html.escape(worst.rollout_id) in page
            rewards = [t.reward for t in trials if t.reward is not None]
            assert best.reward == max(rewards, default=None) and worst.reward in (min(rewards, default=None), None)
    truncated = [
        s for d in ("step_0", "step_1") for s in read_samples(run_dir / "details" / d) if s.status == "TRUNCATED"
    ]
    if any(html.escape(s.rollout_id) in page for s in truncated):
        assert "cut off here" in page


@pytest.mark.skipif(chromium_path() is None, reason="chromium is not installed (./run.sh test installs it)")
def test_the_viewer_renders_in_chromium(run_dir, tmp_path):
    with Browser(tmp_path / "profile", width=1300, height=1400) as browser:
        text = browser.open(RunPaths(run_dir).viewer.resolve().as_uri(), ["Trajectories of run viewed", "step_1"])
        assert "reward" in text and "assistant" in text
        shot = browser.screenshot(OUTPUT / "viewer.png")
    assert shot.stat().st_size > 10_000


def _groups(details):
    groups = {}
    for s in read_samples(details):
        if s.segment_index == 0:
            groups.setdefault(s.group_id, []).append(s)
    return groups
