"""The Prefect UI in headless Chromium (Debian's `chromium`): the manual-train deployment's run form is a typed form
(descriptions, dropdowns for choices, defaults filled in), and the finished run shows its artifacts. Screenshots
go to test-output/deployments/ at the repository root."""

from __future__ import annotations

import json
import time

import pytest

from tests.system.deployments.browser import Browser, chromium_path
from tests.system.deployments.conftest import OUTPUT, POOL, artifacts_of

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        chromium_path() is None,
        reason="chromium is not installed (`apt-get install chromium`; ./run.sh test installs it)",
    ),
]

SELECTS = "[...document.querySelectorAll('select')].map(s => [...s.options].map(o => o.value))"
SELECTED = "[...document.querySelectorAll('select')].map(s => s.value)"
VALUES = "[...document.querySelectorAll('input, textarea')].map(e => e.value)"


@pytest.fixture(scope="module")
def browser(prefect_stack):
    with Browser(prefect_stack.tmp / "chromium" / "profile", width=1440, height=2200) as b:
        yield b


def _shot(browser, name: str, height: int = 1100) -> None:
    path = browser.screenshot(OUTPUT / name, height=height)
    print(f"screenshot: {path}")


def test_manual_train_run_form(prefect_stack, browser):
    dep = prefect_stack.deployments["manual-train"]
    text = browser.open(
        f"{prefect_stack.ui}/deployments/deployment/{dep['id']}/run",
        ["manual-train", "Parameters", "Run Id", "Temperature", "Backend", "Loss Aggregation"],
    )
    # Field names and their descriptions (from RunConfig's Field descriptions), rendered.
    for label, description in [
        ("config", "The whole run: the model and task set"),
        ("Run Id", "Names the run dir, the flow run and its artifacts"),
        ("Temperature", "Sampling temperature (0 = greedy)"),
        ("Steps", "Training steps (rollout -> evaluate -> GRPO update)."),
        ("On Retries Exhausted", "What happens to a GRPO group when one of its trials still fails"),
    ]:
        assert label in text and description in text, f"{label!r} / {description!r} not in the form"
    # Choices are dropdowns with exactly the allowed values, preset to the default.
    selects = browser.evaluate(SELECTS)
    assert ["token", "sample"] in selects and ["drop_group", "keep_group"] in selects, selects
    selected = browser.evaluate(SELECTED)
    assert {"token", "drop_group"} <= set(selected), selected
    # Defaults are filled in.
    values = browser.evaluate(VALUES)
    assert {"smollm2-135m-instruct", "builtin", "runs", "0.5", "16"} <= set(values), values
    _shot(browser, "manual-train-run-form.png", height=2200)
    # The engine is a type per backend: a choice of the five, and below it the chosen one's settings alone.
    backends = ["embedded", "sglang", "vllm", "sglang-launch", "vllm-launch"]
    buttons = browser.evaluate("[...document.querySelectorAll('button')].map(b => b.innerText.trim())")
    assert [b for b in buttons if b in backends] == backends, buttons
    labels = set(browser.text().splitlines())
    assert "Router Policy (Optional)" in labels and not {"Url", "Mem Fraction Static (Optional)"} & labels, labels
    browser.click_text("sglang-launch")
    deadline = time.monotonic() + 30
    while "Mem Fraction Static (Optional)" not in (labels := set(browser.text().splitlines())):
        assert time.monotonic() < deadline, "choosing sglang-launch showed no launch settings"
        time.sleep(0.3)
    assert "Max Total Tokens (Optional)" in labels and "Router Policy (Optional)" not in labels
    _shot(browser, "manual-train-run-form-sglang-launch.png", height=2200)
    # The harness and the sandbox are types too: a choice of each, the chosen one's settings below it.
    buttons = browser.evaluate("[...document.querySelectorAll('button')].map(b => b.innerText.trim())")
    for variants in (["shell", "terminus-2", "claude-code", "opencode"], ["local", "harbor"]):
        assert [b for b in buttons if b in variants] == variants, buttons
    assert not {"Summarize (Optional)", "Api Key File (Optional)"} & labels, labels
    for choice, shows in [("terminus-2", "Summarize (Optional)"), ("harbor", "Api Key File (Optional)")]:
        browser.click_text(choice)
        deadline = time.monotonic() + 30
        while shows not in set(browser.text().splitlines()):
            assert time.monotonic() < deadline, f"choosing {choice} did not show {shows!r}"
            time.sleep(0.3)
    assert "Tool Call Parser (Optional)" not in set(browser.text().splitlines())  # claude-code's and opencode's
    assert any("e2b" in s and "local" not in s for s in browser.evaluate(SELECTS))  # Harbor's environments
    _shot(browser, "manual-train-run-form-terminus-2-harbor.png", height=2200)


# Types into the form as a person does (the value setter plus an `input` event is what Vue listens to).
SET_FIELD = """((label, value) => {
  const lab = [...document.querySelectorAll('.schema-form-property__label')]
    .find(l => l.innerText.trim().startsWith(label));
  const input = lab.closest('.schema-form-property').querySelector('input, textarea');
  Object.getOwnPropertyDescriptor(Object.getPrototypeOf(input), 'value').set.call(input, value);
  input.dispatchEvent(new Event('input', {bubbles: true}));
  input.dispatchEvent(new Event('change', {bubbles: true}));
  input.dispatchEvent(new Event('blur', {bubbles: true}));
  lab.scrollIntoView({block: 'center'});
  return input.value;
})"""
GET_FIELD = """((label) => {
  const lab = [...document.querySelectorAll('.schema-form-property__label')]
    .find(l => l.innerText.trim().startsWith(label));
  return lab.closest('.schema-form-property').querySelector('input, textarea').value;
})"""


def _set_fields_until_they_stay(browser, values: dict[str, str], timeout_s: float = 30.0) -> None:
    """Type `values` (label -> text) into the form until a second later they still read back. Under load the
    form can mount, then render again (schema and defaults arrive late), wiping what was typed: a submit then
    sends the defaults. Typing again until the values stay is what a person looking at the form would do."""
    deadline = time.monotonic() + timeout_s
    while True:
        for label, value in values.items():
            browser.evaluate(f"{SET_FIELD}({json.dumps(label)}, {json.dumps(value)})")
        time.sleep(1.0)
        read = {label: browser.evaluate(f"{GET_FIELD}({json.dumps(label)})") for label in values}
        if read == values:
            return
        assert time.monotonic() < deadline, f"the form did not keep the typed values: {read}"


def test_form_refuses_an_out_of_range_value(prefect_stack, browser):
    dep = prefect_stack.deployments["manual-train"]
    before = {fr["id"] for fr in prefect_stack.flow_runs("manual-train")}
    # Should the refusal ever fail, nothing may run: the pool is paused while the form is submitted, a run
    # created anyway is deleted, and its config points at a missing model (it would die at preflight).
    assert prefect_stack.request("PATCH", f"/work_pools/{POOL}", {"is_paused": True}).status_code == 204
    try:
        browser.open(f"{prefect_stack.ui}/deployments/deployment/{dep['id']}/run", ["Temperature", "Submit"])
        missing_model = str(prefect_stack.tmp / "no-such-model")
        _set_fields_until_they_stay(browser, {"Source": missing_model, "Temperature": "7"})
        browser.click_text("Submit")
        message = "Validation failed for field 'config.rollout.sampling.temperature'"
        deadline = time.monotonic() + 30
        while message not in browser.text():
            assert time.monotonic() < deadline, f"no refusal shown:\n{browser.text()[-2000:]}"
            time.sleep(0.3)
        assert "greater than the maximum of 2.0" in browser.text()
        assert f"/deployments/deployment/{dep['id']}/run" in browser.evaluate("location.href")  # still on the form
        created = {fr["id"] for fr in prefect_stack.flow_runs("manual-train")} - before
        assert not created, "a refused form still created a flow run"
        _shot(browser, "manual-train-form-refused.png", height=2200)
    finally:
        for fr_id in {fr["id"] for fr in prefect_stack.flow_runs("manual-train")} - before:
            prefect_stack.delete(f"/flow_runs/{fr_id}")
        prefect_stack.request("PATCH", f"/work_pools/{POOL}", {"is_paused": False})


def test_nightly_evaluate_form_shows_its_parameters(prefect_stack, browser):
    dep = prefect_stack.deployments["nightly-evaluate"]
    browser.open(
        f"{prefect_stack.ui}/deployments/deployment/{dep['id']}/run",
        ["nightly-evaluate", "split (Optional)", "Which prompts to evaluate"],
    )
    assert ["eval", "train", "all"] in browser.evaluate(SELECTS)
    assert "eval" in browser.evaluate(SELECTED)
    browser.open(f"{prefect_stack.ui}/deployments/deployment/{dep['id']}", ["nightly-evaluate", "Triggers"])
    _shot(browser, "nightly-evaluate-deployment.png")


def test_finished_run_shows_its_artifacts(prefect_stack, finished_run, browser):
    fr, rid = finished_run["flow_run"], finished_run["config"]["run_id"]
    browser.open(f"{prefect_stack.ui}/runs/flow-run/{fr['id']}", [fr["name"], "Completed", "Artifacts"])
    browser.click_text("Artifacts", selector="[role=tab], li.p-tab, button")
    keys = [f"{rid}-summary", f"{rid}-steps", f"{rid}-run-dir", f"{rid}-step-0-trials"]
    deadline = time.monotonic() + 60
    while not all(k in browser.text() for k in keys):
        assert time.monotonic() < deadline, f"artifacts {keys} not shown:\n{browser.text()[:3000]}"
        time.sleep(0.5)
    _shot(browser, "flow-run-artifacts.png")
    summary = artifacts_of(prefect_stack, fr["id"])[f"{rid}-summary"]
    text = browser.open(f"{prefect_stack.ui}/artifacts/artifact/{summary['id']}", [rid, "reward"])
    assert str(finished_run["run_dir"]) in text
    assert browser.evaluate("[...document.querySelectorAll('img')].some(i => i.complete && i.naturalWidth > 100)"), (
        "the summary's curves image did not render"
    )
    _shot(browser, "run-summary-artifact.png")


def test_deployments_page_and_rerun_form(prefect_stack, browser):
    deployed = sorted(prefect_stack.deployments)
    browser.open(f"{prefect_stack.ui}/deployments", deployed)
    _shot(browser, "deployments.png", height=800)
    if "rerun" not in prefect_stack.deployments:
        pytest.skip("flows/rerun.py is not in the tree yet")
    dep = prefect_stack.deployments["rerun"]
    text = browser.open(f"{prefect_stack.ui}/deployments/deployment/{dep['id']}/run", ["rerun", "run_id"])
    lines = [line.strip() for line in text.splitlines()]
    assert "run_id" in lines and "run_id (Optional)" not in lines, "run_id must be a required field of the form"
    assert "new_run_id (Optional)" in lines and "The original run: the name of its dir under output_dir." in lines
    _shot(browser, "rerun-run-form.png", height=900)
