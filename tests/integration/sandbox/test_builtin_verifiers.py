"""The built-in tasks' verifiers grade the task, not the look of the answer, and ignore a reward the agent plants.

Near-miss answers run as real Harbor trials in `LocalSandbox`: `CommandAgent` (below) execs the answer, then
Harbor's verifier runs the task's `tests/test.sh`, and the reward it wrote to `/logs/verifier/reward.txt` (the
trial's verifier dir, bound there) is checked. All trials run once, concurrently, per module.

A planted reward must not count: end to end (Harbor's verifier deletes it, test.sh ignores it), and in test.sh
alone, run in a `LocalSandbox` the way Harbor's verifier runs it but without Harbor's cleanup first.

Oracle 1.0 / nop 0.0 on every task is `test_sandbox_harbor.py`'s; the sandbox having no network is
`test_sandbox_isolation.py`'s.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from typing import Any

import pytest
from harbor.agents.base import BaseAgent
from harbor.environments.base import BaseEnvironment
from harbor.models.agent.context import AgentContext
from harbor.models.task.config import TaskOS
from harbor.models.trial.config import (
    AgentConfig,
    EnvironmentConfig,
    TaskConfig,
    TrialConfig,
)
from harbor.models.trial.paths import EnvironmentPaths, TrialPaths
from harbor.trial.trial import Trial
from harbor.utils.scripts import build_execution_command

from grpoflow.embedded.sandbox.local import LocalSandbox
from grpoflow.prepare.dataset import TaskSpec, load_dataset
from grpoflow.rollout.environments import LOCAL_SANDBOX_IMPORT_PATH

TASKS = load_dataset("builtin-fixed").tasks
CONCURRENCY = 8  # as in test_sandbox_harbor.py: each trial mostly waits on short bwrap processes
ENV_PATHS = EnvironmentPaths.for_os(TaskOS.LINUX)
PLANT_REWARDS = f"echo 1 > {ENV_PATHS.reward_text_path} && echo '{{\"reward\": 1}}' > {ENV_PATHS.reward_json_path}"


class CommandAgent(BaseAgent):
    """Runs one shell command in the environment; its exit status is irrelevant, only the resulting /app is
    scored. Loaded by Harbor as `tests.integration.sandbox.test_builtin_verifiers:CommandAgent`."""

    def __init__(self, *args: Any, command: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.command = command

    @staticmethod
    def name() -> str:
        return "command-agent"

    def version(self) -> str:
        return "1"

    async def setup(self, environment: BaseEnvironment) -> None:
        return None

    async def run(self, instruction: str, environment: BaseEnvironment, context: AgentContext) -> None:
        await environment.exec(self.command, timeout_sec=60)


_SUM_WITH_STRAY_CHILD = """cat > /app/sum.sh <<'EOF'
#!/bin/bash
sleep 300 &
total=0
while read -r n; do total=$((total + n)); done < "$1"
echo "$total"
EOF"""

# Plausible wrong or partial answers a small model gives, with the reward each must get: the verifiers grade
# the task, not the look of the output.
NEAR_MISSES = [
    ("hello-file", "printf hello > /app/hello.txt", 1.0),  # no trailing newline is fine
    ("hello-file", "echo Hello > /app/hello.txt", 0.0),
    ("hello-file", "ln -s /tests/expected.txt /app/hello.txt", 0.0),
    ("touch-done", "echo > /app/done", 0.5),
    ("touch-done", "mkdir /app/done", 0.0),
    ("answer-42", "echo ' 42 ' > /app/answer.txt", 1.0),
    ("answer-42", "echo 'The answer is 42' > /app/answer.txt", 0.0),
    ("copy-file", "mv /app/source.txt /app/backup.txt", 0.5),
    ("rename-file", "cp /app/draft.txt /app/final.txt", 0.5),
    ("delete-file", "rm -f /app/*", 0.0),
    ("count-lines", "wc -l /app/data.txt > /app/count.txt", 0.5),
    ("count-lines", "echo 36 > /app/count.txt", 0.0),
    ("sort-lines", "sort -r /app/names.txt > /app/sorted.txt", 0.0),
    ("replace-word", "sed 's/cat/dog/g' /app/story.txt", 0.0),  # printed, not edited in place
    ("extract-column", "cut -d, -f3 /app/people.csv > /app/cities.txt", 0.5),
    ("make-executable", "chmod +x /app/run.sh && echo 'echo extra' >> /app/run.sh", 0.0),
    ("make-executable", "chmod 644 /app/run.sh", 0.0),
    ("find-logs", "find /app/logs -name '*.log' | sort -r > /app/found.txt", 0.0),
    ("find-logs", "ls /app/logs/*.log > /app/found.txt", 0.0),  # misses subdirectories
    ("fix-script", "printf '#!/bin/bash\\necho 15\\n' > /app/sum.sh", 0.0),
    ("fix-script", _SUM_WITH_STRAY_CHILD, 1.0),  # right answer; its stray child must not stall the verifier
    ("prime-function", "echo 'is_prime() { return 1; }' > /app/prime.sh", 0.0),
    ("prime-function", "echo 'echo loaded; is_prime() { factor $1 | awk \"NF!=2{exit 1}\"; }' > /app/prime.sh", 0.0),
    ("concat-checksum", "cat /app/parts/*.txt > /app/whole.txt && sha256sum /app/whole.txt > /app/whole.sha256", 0.5),
    ("concat-checksum", "cat /app/parts/part3.txt /app/parts/part1.txt > /app/whole.txt", 0.0),
    ("log-summary", "awk '{print $NF}' /app/access.log | sort | uniq -c > /app/summary.txt", 0.0),
    ("top-words", "printf 'the\\nriver\\nstone\\n' > /app/top3.txt", 1.0),  # typed by hand still counts
    ("top-words", "printf 'The\\nriver\\nstone\\n' > /app/top3.txt", 0.0),
    ("region-totals", "cp /app/sales.csv /app/totals.txt", 0.0),
    ("config-edit", "sed -i 's/9000/8080/' /app/config.ini", 0.0),  # every section's port
    ("config-edit", "sed -i 's/port = 9000/port = 8080/2' /app/config.ini", 0.0),
]
NEAR_MISS_IDS = [f"{name}-{i}" for i, (name, _, _) in enumerate(NEAR_MISSES)]
# One trial per near miss, and one per task whose agent only plants a reward (it must score 0 end to end).
TRIALS = {
    **{f"near-miss-{i}": (name, command) for i, (name, command, _) in zip(NEAR_MISS_IDS, NEAR_MISSES, strict=True)},
    **{f"planted-{task.name}": (task.name, PLANT_REWARDS) for task in TASKS},
}


def _task(name: str) -> TaskSpec:
    return next(t for t in TASKS if t.name == name)


Outcome = tuple[float | None, float | None, str]  # (Harbor's reward, reward.txt's, what went wrong)


@pytest.fixture(scope="module")
def trials(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """Runs every trial in TRIALS concurrently; trial name -> its outcome."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed: apt-get install -y bubblewrap")
    trials_dir = tmp_path_factory.mktemp("trials")
    sandbox_dirs = tmp_path_factory.mktemp("sandboxes")
    sandbox = EnvironmentConfig(
        import_path=LOCAL_SANDBOX_IMPORT_PATH, kwargs={"work_dir": str(sandbox_dirs), "base_images": {}}
    )

    async def run(trial_name: str, task_name: str, command: str, gate: asyncio.Semaphore) -> Outcome:
        config = TrialConfig(
            trial_name=trial_name,
            task=TaskConfig(path=_task(task_name).path),
            agent=AgentConfig(import_path=f"{__name__}:CommandAgent", kwargs={"command": command}),
            trials_dir=trials_dir,
            environment=sandbox,
        )
        async with gate:
            result = await (await Trial.create(config)).run()
        # The trial's verifier dir is what the sandbox had at /logs/verifier.
        paths = TrialPaths(trials_dir / trial_name)
        harbor = result.verifier_result.rewards.get("reward") if result.verifier_result else None
        txt = float(paths.reward_text_path.read_text()) if paths.reward_text_path.is_file() else None
        log = paths.test_stdout_path.read_text(errors="replace") if paths.test_stdout_path.is_file() else "(none)"
        return harbor, txt, f"exception: {result.exception_info}\ntest.sh said:\n{log}"

    async def main() -> list[Outcome]:
        gate = asyncio.Semaphore(CONCURRENCY)
        return await asyncio.gather(*[run(name, task, command, gate) for name, (task, command) in TRIALS.items()])

    outcomes = dict(zip(TRIALS, asyncio.run(main()), strict=True))
    assert list(sandbox_dirs.iterdir()) == []  # every per-trial sandbox dir was deleted at stop()
    return outcomes


@pytest.mark.parametrize(
    ("case_id", "name", "command", "expected"),
    [pytest.param(case_id, *case, id=case_id) for case_id, case in zip(NEAR_MISS_IDS, NEAR_MISSES, strict=True)],
)
def test_near_miss_rewards(case_id: str, name: str, command: str, expected: float, trials: dict[str, Outcome]) -> None:
    harbor, txt, why = trials[f"near-miss-{case_id}"]
    assert (harbor, txt) == (expected, expected), f"{name}: `{command}` scored {harbor} (reward.txt: {txt})\n{why}"


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_planted_reward_does_not_survive(
    task: TaskSpec, trials: dict[str, Outcome], make_sandbox: Callable[..., LocalSandbox]
) -> None:
    # An agent can write to /logs/verifier; a reward it plants (txt, or json which Harbor prefers) must not count.
    # End to end, Harbor's verifier deletes both before running test.sh (and test.sh ignores them):
    harbor, txt, why = trials[f"planted-{task.name}"]
    assert (harbor, txt) == (0.0, 0.0), why

    # test.sh's own guard, without Harbor's cleanup: plant, then run test.sh the way Harbor's verifier does.
    env = make_sandbox(task.name)

    async def main() -> None:
        await env.start(force_build=False)
        planted = await env.exec(PLANT_REWARDS)
        assert planted.return_code == 0, planted.stderr
        await env.upload_dir(task.path / "tests", str(ENV_PATHS.tests_dir))
        stdout_path = ENV_PATHS.verifier_dir / "test-stdout.txt"
        test_sh = ENV_PATHS.tests_dir / "test.sh"
        await env.exec(build_execution_command(test_sh, stdout_path=stdout_path, task_os=TaskOS.LINUX), timeout_sec=60)

    asyncio.run(main())
    paths: TrialPaths = env.trial_paths
    log = paths.test_stdout_path.read_text(errors="replace") if paths.test_stdout_path.is_file() else "(no log)"
    assert paths.reward_text_path.read_text().strip() == "0", log
    assert not paths.reward_json_path.exists(), log
