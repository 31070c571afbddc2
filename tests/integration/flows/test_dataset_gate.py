"""The dataset gate (issue 31), with real Harbor and the real bubblewrap sandbox: each task's oracle and a no-op
agent once, at prepare and in `grpoflow tasks --validate`; what is left out never reaches prompts.jsonl."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from flows.cli import main
from grpoflow.config import parse_run_config
from grpoflow.errors import DatasetError
from grpoflow.prepare.dataset import builtin_dataset_path, load_dataset
from grpoflow.run.health import health_markdown, task_health
from grpoflow.run.start import prepare_run
from grpoflow.scoring import gate as gate_module
from grpoflow.scoring.gate import GateSettings, gate_cache_path, record_flaky, run_gate
from tests.integration.bad_inputs.conftest import assert_one_line

pytestmark = [
    pytest.mark.flow,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"),
]


@pytest.fixture(autouse=True)
def _without_docker(no_docker_engine):
    """`needs-apt` is refused as on a machine without Docker (tests/integration/docker/ covers building it)."""


def _copy(root, builtin, name):
    dest = root / name
    shutil.copytree(builtin_dataset_path() / builtin, dest)
    return dest


def _oracle_fails(root):
    task = _copy(root, "hello-file", "oracle-fails")
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\n# does nothing\nexit 0\n")


def _nop_passes(root):
    task = _copy(root, "make-dir", "nop-passes")
    (task / "tests" / "test.sh").write_text("#!/bin/bash\necho 'checks nothing'\necho 1 > /logs/verifier/reward.txt\n")


def _no_solution(root):
    shutil.rmtree(_copy(root, "touch-done", "no-solution") / "solution")


def _needs_apt(root):
    task = _copy(root, "hello-file", "needs-apt")
    with (task / "environment" / "Dockerfile").open("a") as f:
        f.write("RUN apt-get update && \\\n    apt-get install -y curl\n")


@pytest.fixture
def mixed(tmp_path):
    """good, oracle-fails, nop-passes, no-solution (unverified), needs-apt (refused without Docker)."""
    root = tmp_path / "tasks"
    _copy(root, "hello-file", "good")
    for make in (_oracle_fails, _nop_passes, _no_solution, _needs_apt):
        make(root)
    return root


def _cfg(tmp_path, model, dataset, run_id, **dataset_fields):
    return parse_run_config(
        {
            "run_id": run_id,
            "output_dir": str(tmp_path / "runs"),
            "model": {"source": str(model)},
            "dataset": {"path": str(dataset), **dataset_fields},
        }
    )


def test_prepare_admits_what_the_gate_proves_and_a_second_prepare_runs_no_trial(
    tmp_path, tiny_model_dir, mixed, capsys
):
    cache = tmp_path / "cache"
    t0 = time.perf_counter()
    run = prepare_run(_cfg(tmp_path, tiny_model_dir, mixed, "gate-1"), cache_dir=cache)
    first_s = time.perf_counter() - t0
    gate = json.loads(run.paths.gate.read_text())
    verdicts = {t["name"]: t for t in gate["tasks"]}
    assert {n: t["verdict"] for n, t in verdicts.items()} == {
        "good": "verified",
        "oracle-fails": "oracle-fails",
        "nop-passes": "nop-passes",
        "no-solution": "unverified",
        "needs-apt": "refused",
    }
    assert [n for n, t in verdicts.items() if t["admitted"]] == ["good", "no-solution"]
    # two oracle runs (dataset.gate_oracle_runs) and one no-op per task with a solution, a no-op alone without
    assert (gate["admitted"], gate["left_out"], gate["trials_run"], gate["sandbox"]) == (2, 3, 10, "local")
    # the reasons: the oracle's score and the verifier's last lines; the no-op's pass; the Dockerfile's line
    assert verdicts["oracle-fails"]["oracle_reward"] == 0.0
    assert verdicts["oracle-fails"]["oracle_rewards"] == [0.0, 0.0]
    assert "scored 0.0" in verdicts["oracle-fails"]["reason"]
    assert "/app/hello.txt is missing" in verdicts["oracle-fails"]["reason"]
    assert verdicts["oracle-fails"]["verifier_tail"][-1] == "reward: 0"
    assert verdicts["nop-passes"]["nop_reward"] == 1.0 and "checks nothing" in verdicts["nop-passes"]["reason"]
    assert (
        "environment/Dockerfile:3: `RUN apt-get update && apt-get install -y curl`" in (verdicts["needs-apt"]["reason"])
    )
    assert (verdicts["good"]["oracle_reward"], verdicts["good"]["nop_reward"]) == (1.0, 0.0)
    assert verdicts["no-solution"]["oracle_reward"] is None and verdicts["no-solution"]["nop_reward"] == 0.0
    # what trains and evaluates
    prompts = [json.loads(line) for line in run.paths.prompts.read_text().splitlines()]
    assert sorted(p["instance_id"] for p in prompts) == ["good", "no-solution"]
    assert run.n_tasks == 2
    info = json.loads(run.paths.run_info.read_text())
    assert info["dataset"]["tasks"] == ["good", "no-solution"]
    # the CLI's table: a head line, then one line per task left out
    out = [line for line in capsys.readouterr().out.splitlines() if line.startswith("grpoflow: ")]
    # first what is to run, then (every 10 s while trials run) how far it got
    assert out[0] == "grpoflow: dataset gate: 10 trials of 4 tasks to run (0 verdicts from the cache; 8 at once)"
    out = [line for line in out[1:] if "trials done in" not in line]
    assert out[0].startswith("grpoflow: dataset gate: 2 of 5 tasks admitted, 3 left out")
    assert sorted(line.split(":")[1].strip() for line in out[1:]) == ["nop-passes", "oracle-fails", "refused"]

    # same tasks again (another run): every verdict from the cache, no trial
    t0 = time.perf_counter()
    again = prepare_run(_cfg(tmp_path, tiny_model_dir, mixed, "gate-2"), cache_dir=cache)
    second_s = time.perf_counter() - t0
    gate2 = json.loads(again.paths.gate.read_text())
    assert gate2["trials_run"] == 0
    assert all(t["cached"] for t in gate2["tasks"] if t["verdict"] != "refused")
    assert [t["verdict"] for t in gate2["tasks"]] == [t["verdict"] for t in gate["tasks"]]
    assert again.paths.prompts.read_text() == run.paths.prompts.read_text()
    print(f"gate: first prepare {first_s:.1f} s (10 trials), second {second_s:.1f} s (cached)")

    # a prompts file naming a task the gate left out: that prompt never trains either
    own = tmp_path / "own.jsonl"
    own.write_text("".join(json.dumps({"instance_id": n, "task_path": str(mixed / n)}) + "\n" for n in verdicts))
    cfg = _cfg(tmp_path, tiny_model_dir, mixed, "gate-own").model_copy(update={"prompts": _prompts(own)})
    kept = prepare_run(cfg, cache_dir=cache).paths.prompts.read_text()
    assert sorted(json.loads(line)["instance_id"] for line in kept.splitlines()) == ["good", "no-solution"]

    # a changed task is a new task: only it runs again
    with (mixed / "good" / "instruction.md").open("a") as f:
        f.write("\n")
    gate3 = run_gate(load_dataset(mixed, local_sandbox=True), parse_run_config({}).rollout, cache)
    assert gate3.trials_run == 3 and [t.name for t in gate3.tasks if not t.cached and t.verdict != "refused"] == [
        "good"
    ]


def _prompts(path):
    return parse_run_config({"prompts": {"path": str(path)}}).prompts


def test_a_dataset_with_every_task_left_out_stops_prepare_in_one_line(tmp_path, tiny_model_dir, capsys):
    root = tmp_path / "tasks"
    _oracle_fails(root)
    _needs_apt(root)
    with pytest.raises(DatasetError) as info:
        prepare_run(_cfg(tmp_path, tiny_model_dir, root, "gate-none"), cache_dir=tmp_path / "cache")
    assert_one_line(info.value, root.resolve(), "every task was left out", "1 oracle-fails", "1 refused")
    assert not (tmp_path / "runs" / "gate-none").exists()
    assert "oracle-fails: its oracle (solution/solve.sh) scored 0.0" in capsys.readouterr().out


def test_gate_off_and_the_builtin_set_run_no_trial(tmp_path, tiny_model_dir, mixed, capsys):
    run = prepare_run(
        _cfg(tmp_path, tiny_model_dir, mixed, "gate-off", validate=False),
        cache_dir=tmp_path / "cache",
    )
    gate = json.loads(run.paths.gate.read_text())
    assert gate["gated"] is False and gate["trials_run"] == 0
    # not gated: only the refusal stands (the task would run in the wrong environment whatever the gate says)
    assert [t["name"] for t in gate["tasks"] if not t["admitted"]] == ["needs-apt"]
    assert not (tmp_path / "cache" / "gate").exists()
    builtin = prepare_run(_cfg(tmp_path, tiny_model_dir, "builtin", "gate-builtin"), cache_dir=tmp_path / "cache")
    assert json.loads(builtin.paths.gate.read_text())["gated"] is False
    assert not (tmp_path / "cache" / "gate").exists()


def test_a_sandbox_failure_is_no_verdict_on_the_task(tmp_path, faulty_sandbox):
    root = tmp_path / "tasks"
    _copy(root, "hello-file", "good")
    rollout = parse_run_config(
        {"rollout": {"sandbox": {"retries": 1, "retry_backoff_s": 0.01, "kwargs": {"fail_start_probability": 1.0}}}}
    ).rollout
    report = run_gate(load_dataset(root, local_sandbox=True), rollout, tmp_path / "cache")
    [task] = report.tasks
    assert (task.verdict, task.admitted) == ("unchecked", True)
    assert "infrastructure failure" in task.reason and "SandboxStartError" in task.reason
    assert not list((tmp_path / "cache").rglob("*.json"))  # not cached: the next prepare tries again


def test_tasks_validate_prints_the_table_and_names_why_nothing_is_left(tmp_path, mixed, capfd, monkeypatch):
    monkeypatch.setenv("GRPOFLOW_CACHE", str(tmp_path / "cache"))
    assert main(["tasks", "--validate", "--dataset", str(mixed)]) == 0
    out = capfd.readouterr().out.splitlines()
    assert "10 trials of 4 tasks to run" in out[0] and "2 of 5 tasks admitted, 3 left out" in out[1]
    assert any(line.startswith("grpoflow:   oracle-fails: oracle-fails: its oracle") for line in out)
    assert out[-1] == f"grpoflow: 2 tasks of {mixed.resolve()} would train and evaluate"

    for name in ("good", "no-solution"):
        shutil.rmtree(mixed / name)
    assert main(["tasks", "--validate", "--dataset", str(mixed)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert_one_line(err[-1], "every task was left out", "1 nop-passes", "1 oracle-fails", "1 refused")

    assert main(["tasks", "--validate"]) == 2
    assert "--validate and --dataset PATH go together" in capfd.readouterr().err


def test_the_prepare_flow_never_trains_an_oracle_failing_task(tmp_path, tiny_model_dir, mixed, capfd, monkeypatch):
    monkeypatch.setenv("GRPOFLOW_CACHE", str(tmp_path / "cache"))
    argv = ["prepare", "--output-dir", str(tmp_path / "runs"), "--run-id", "gate-flow", "--model", str(tiny_model_dir)]
    assert main([*argv, "--dataset", str(mixed)]) == 0
    root = tmp_path / "runs" / "gate-flow"
    prompts = (root / "prompts.jsonl").read_text()
    assert '"good"' in prompts and "oracle-fails" not in prompts and "nop-passes" not in prompts
    assert json.loads((root / "gate.json").read_text())["left_out"] == 3
    assert "gate.json" in capfd.readouterr().out  # the CLI lists it among the run's artifacts


def test_task_health_names_what_the_gate_left_out(tmp_path, tiny_model_dir, mixed):
    """The morning report lists a task the gate left out, with the verdict, though no trial of it ever ran."""
    run = prepare_run(_cfg(tmp_path, tiny_model_dir, mixed, "gate-health"), cache_dir=tmp_path / "cache")
    run_ids, tasks = task_health(run.paths.root.parent)
    health = {t.task: t for t in tasks}
    assert run_ids == ["gate-health"]
    assert health["oracle-fails"].flag == "left out by the gate: oracle-fails"
    assert health["nop-passes"].flag == "left out by the gate: nop-passes"
    assert health["needs-apt"].flag == "left out by the gate: refused"
    assert "good" not in health  # admitted, and none of its trials has run yet
    assert "| oracle-fails | left out (oracle-fails) | left out by the gate: oracle-fails |" in health_markdown(
        run_ids, tasks
    )


def _two_rewards(root):
    """A verifier in the shape of Harbor's multi-reward example: reward.json with two keys, none `reward`."""
    task = root / "two-rewards"
    for sub in ("environment", "solution", "tests"):
        (task / sub).mkdir(parents=True)
    (task / "task.toml").write_text(
        '[metadata]\ndifficulty = "easy"\ncategory = "file"\n\n[agent]\ntimeout_sec = 60.0\n\n'
        '[environment]\nnetwork_mode = "no-network"\nworkdir = "/app"\n'
    )
    (task / "instruction.md").write_text("Write hi into /app/out.txt.\n")
    (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\n")
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\necho hi > /app/out.txt\n")
    (task / "tests" / "test.sh").write_text(
        "#!/bin/bash\nmkdir -p /logs/verifier\nok=0\n"
        '[ "$(cat /app/out.txt 2>/dev/null)" = hi ] && ok=1\n'
        'echo "{\\"tests\\": $ok, \\"style\\": 1}" > /logs/verifier/reward.json\n'
    )
    return root


def test_several_rewards_are_left_out_until_dataset_reward_says_how_to_score_them(tmp_path):
    dataset = load_dataset(_two_rewards(tmp_path / "tasks"), local_sandbox=True)
    rollout = parse_run_config({}).rollout
    [undeclared] = run_gate(dataset, rollout, tmp_path / "cache").tasks
    assert not undeclared.admitted
    assert "reward.json has keys ['style', 'tests'] but no `reward`: set dataset.reward" in undeclared.reason
    # the mean of both: the oracle reaches 1.0, the no-op 0.5 (style only); a cached verdict is per rule
    mean = parse_run_config({"run_id": "r", "dataset": {"reward": {"tests": 1, "style": 1}}}).dataset.reward_rule()
    [declared] = run_gate(dataset, rollout, tmp_path / "cache", mean).tasks
    assert declared.admitted and (declared.oracle_reward, declared.nop_reward) == (1.0, 0.5)
    # the style key alone: the no-op already scores 1, so the verifier does not check the work
    style = parse_run_config({"run_id": "r", "dataset": {"reward": "style"}}).dataset.reward_rule()
    [flat] = run_gate(dataset, rollout, tmp_path / "cache", style).tasks
    assert not flat.admitted and flat.nop_reward == 1.0


def _second_look_fails(root):
    """A verifier that consults state outside its trial (as one that asks an outside service would): the first
    oracle run to be verified passes, every later one fails; the no-op never gets that far."""
    task = _copy(root, "hello-file", "flaky")
    test = task / "tests" / "test.sh"
    test.write_text(
        test.read_text().replace(
            "finish 1",
            'mkdir /shared/first-look 2>/dev/null || fail "the outside service says no this time"\nfinish 1',
        )
    )


def _needs_network(root):
    """A verifier that installs its test runner first, as Harbor's own examples do: without network, no name
    resolves (nothing leaves the sandbox: its namespace has no interface but loopback)."""
    task = _copy(root, "hello-file", "needs-network")
    test = task / "tests" / "test.sh"
    install = (
        "python3 -c \"import socket; socket.getaddrinfo('pypi.org', 443)\" 2>&1 | tail -n 1\n"
        '[ "${PIPESTATUS[0]}" = 0 ] || fail "could not install the test runner"\n'
    )
    test.write_text(test.read_text().replace("need_file /app/hello.txt", install + "need_file /app/hello.txt"))


def test_a_verifier_that_disagrees_with_itself_is_flaky_and_one_without_network_needs_network(
    tmp_path, faulty_sandbox, monkeypatch
):
    root = tmp_path / "tasks"
    _copy(root, "hello-file", "good")
    _second_look_fails(root)
    _needs_network(root)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # the sandbox's own uid writes there
    rollout = parse_run_config({"rollout": {"sandbox": {"kwargs": {"shared_dir": str(shared)}}}}).rollout
    lines: list[str] = []
    monkeypatch.setattr(gate_module, "PROGRESS_EVERY_S", 0.5)
    report = run_gate(load_dataset(root, local_sandbox=True), rollout, tmp_path / "cache", progress=lines.append)
    verdicts = {t.name: t for t in report.tasks}
    assert {n: t.verdict for n, t in verdicts.items()} == {
        "good": "verified",
        "flaky": "flaky",
        "needs-network": "needs-network",
    }
    flaky = verdicts["flaky"]
    assert sorted(flaky.oracle_rewards) == [0.0, 1.0] and not flaky.admitted
    # both verifiers' last lines: the failing run's and the passing run's
    assert "passed 1 of 2 runs" in flaky.reason and "the outside service says no this time" in flaky.reason
    assert "passing run's: reward: 1" in flaky.reason
    network = verdicts["needs-network"]
    assert "name resolution" in network.reason or "not known" in network.reason, network.reason
    assert not network.admitted and network.oracle_rewards == [0.0, 0.0]
    # the gate talked while it ran: a head line, then done/total with an ETA
    assert lines[0] == "dataset gate: 9 trials of 3 tasks to run (0 verdicts from the cache; 8 at once)"
    assert any("trials done in" in line and "ETA" in line for line in lines[1:]), lines


def test_a_verdict_that_leaves_a_task_out_expires_and_fresh_runs_every_task_again(tmp_path, monkeypatch, capfd):
    root = tmp_path / "tasks"
    _copy(root, "hello-file", "good")
    _oracle_fails(root)
    dataset, rollout, cache = load_dataset(root, local_sandbox=True), parse_run_config({}).rollout, tmp_path / "cache"
    assert run_gate(dataset, rollout, cache).trials_run == 6
    again = run_gate(dataset, rollout, cache)
    assert again.trials_run == 0 and all(t.cached for t in again.tasks)

    # eight days on: the negative verdict is stale (dataset.gate_ttl, 7 days), the positive one still holds
    for path in (cache / "gate").rglob("*.json"):
        record = json.loads(path.read_text())
        path.write_text(json.dumps(record | {"at": record["at"] - 8 * 86400}))
    later = {t.name: t for t in run_gate(dataset, rollout, cache).tasks}
    assert (later["good"].cached, later["oracle-fails"].cached) == (True, False)
    assert later["oracle-fails"].verdict == "oracle-fails"
    # a longer ttl trusts it again; another grpoflow (its code digest) does not
    assert run_gate(dataset, rollout, cache, settings=GateSettings(ttl_days=30)).trials_run == 0
    monkeypatch.setattr(gate_module, "code_digest", lambda: "another-grpoflow")
    assert run_gate(dataset, rollout, cache, settings=GateSettings(ttl_days=30)).trials_run == 3
    monkeypatch.undo()

    # `grpoflow tasks --validate --fresh` runs every task again
    monkeypatch.setenv("GRPOFLOW_CACHE", str(cache))
    assert main(["tasks", "--validate", "--fresh", "--dataset", str(root)]) == 0
    out = capfd.readouterr().out
    assert "6 trials in" in out and "0 verdicts from the cache" in out
    assert main(["tasks", "--validate", "--dataset", str(root)]) == 0
    assert "0 trials in" in capfd.readouterr().out
    assert main(["tasks", "--fresh"]) == 2
    assert "--fresh goes with --validate" in capfd.readouterr().err


def test_a_regrade_that_finds_a_verifier_flaky_leaves_the_task_out_at_the_next_prepare(tmp_path):
    root = tmp_path / "tasks"
    _copy(root, "hello-file", "good")
    _copy(root, "make-dir", "flips-on-regrade")
    dataset, rollout, cache = load_dataset(root, local_sandbox=True), parse_run_config({}).rollout, tmp_path / "cache"
    assert all(t.admitted for t in run_gate(dataset, rollout, cache).tasks)
    path = record_flaky(
        root / "flips-on-regrade", rollout, cache, "a regrade of step 3 scored 0.0 where the run recorded 1.0"
    )
    assert path.parent == gate_cache_path(cache, "local", "x").parent
    report = run_gate(dataset, rollout, cache)
    verdicts = {t.name: t for t in report.tasks}
    assert report.trials_run == 0
    assert (verdicts["flips-on-regrade"].verdict, verdicts["flips-on-regrade"].cached) == ("flaky", True)
    assert "scored 0.0 where the run recorded 1.0" in verdicts["flips-on-regrade"].reason
    assert verdicts["good"].admitted
