"""Every built-in task: its oracle (`solution/solve.sh`) scores 1.0 and doing nothing scores 0.0.

Runs each task in a bubblewrap sandbox laid out the way Harbor lays out a trial (`/app` holding a copy of the
task's `environment/app/`, `/logs/verifier`, `/tests` and `/solution` read-only), with no network and only the
host's /usr. The `_sandbox` helper is a stand-in for grpoflow's Harbor sandbox environment.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from grpoflow.dataset import TaskSpec, load_dataset

BWRAP = shutil.which("bwrap")
pytestmark = pytest.mark.skipif(
    BWRAP is None, reason="bubblewrap (bwrap) is not installed: apt-get install -y bubblewrap"
)

TASKS = load_dataset("builtin").tasks
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _sandbox(task: TaskSpec, work: Path, command: str) -> subprocess.CompletedProcess[str]:
    """Run `command` with bash in a fresh sandbox over `work`'s app/ and logs/ dirs (kept between calls)."""
    # Only where the host has it: a dangling /lib64 link would hide a missing loader rather than fail.
    lib64 = ["--symlink", "usr/lib64", "/lib64"] if Path("/usr/lib64").is_dir() else []
    argv = [
        BWRAP,
        "--ro-bind", "/usr", "/usr",
        "--symlink", "usr/bin", "/bin",
        "--symlink", "usr/lib", "/lib",
        *lib64,
        "--symlink", "usr/sbin", "/sbin",
        "--ro-bind", "/etc", "/etc",
        "--proc", "/proc",
        "--dev", "/dev",
        "--tmpfs", "/tmp",
        "--bind", str(work / "app"), "/app",
        "--bind", str(work / "logs"), "/logs",
        "--ro-bind", str(task.path / "tests"), "/tests",
        "--ro-bind", str(task.path / "solution"), "/solution",
        "--unshare-net",
        "--unshare-pid",
        "--die-with-parent",
        "--chdir", "/app",
        "--clearenv",
        "--setenv", "PATH", PATH,
        "--setenv", "HOME", "/root",
        "--setenv", "LANG", "C.UTF-8",
    ]  # fmt: skip
    return subprocess.run(
        [*argv, "/bin/bash", "-c", command], capture_output=True, text=True, timeout=120, check=False
    )


def _fresh_trial(task: TaskSpec, tmp_path: Path) -> Path:
    """A trial dir: app/ is a copy of the task's environment/app (empty if it has none), logs/ as Harbor makes."""
    app_src = task.path / "environment" / "app"
    if app_src.is_dir():
        shutil.copytree(app_src, tmp_path / "app")
    else:
        (tmp_path / "app").mkdir()
    for sub in ("agent", "verifier", "artifacts"):
        (tmp_path / "logs" / sub).mkdir(parents=True)
    return tmp_path


def _verify(task: TaskSpec, work: Path) -> float:
    # Harbor runs the script by path (its shebang and exec bit matter), from the workdir.
    result = _sandbox(task, work, "/tests/test.sh > /logs/verifier/test-stdout.txt 2>&1")
    reward_file = work / "logs" / "verifier" / "reward.txt"
    log = (work / "logs" / "verifier" / "test-stdout.txt").read_text(errors="replace")
    assert reward_file.is_file(), f"{task.name}: test.sh wrote no reward (rc={result.returncode}):\n{log}"
    return float(reward_file.read_text())


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_oracle_scores_one(task: TaskSpec, tmp_path: Path) -> None:
    work = _fresh_trial(task, tmp_path)
    solve = _sandbox(task, work, "/solution/solve.sh")
    assert solve.returncode == 0, f"{task.name}: solve.sh failed:\n{solve.stdout}{solve.stderr}"
    reward = _verify(task, work)
    log = (work / "logs" / "verifier" / "test-stdout.txt").read_text()
    assert reward == 1.0, f"{task.name}: oracle scored {reward}:\n{log}"


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_nop_scores_zero(task: TaskSpec, tmp_path: Path) -> None:
    work = _fresh_trial(task, tmp_path)
    assert _verify(task, work) == 0.0


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_planted_reward_does_not_survive(task: TaskSpec, tmp_path: Path) -> None:
    # An agent can write to /logs/verifier; a reward it plants (txt, or json which Harbor prefers) must not count.
    work = _fresh_trial(task, tmp_path)
    (work / "logs" / "verifier" / "reward.txt").write_text("1\n")
    (work / "logs" / "verifier" / "reward.json").write_text('{"reward": 1}\n')
    assert _verify(task, work) == 0.0
    assert not (work / "logs" / "verifier" / "reward.json").exists()


def test_sandbox_has_no_network(tmp_path: Path) -> None:
    # The tasks promise to run offline; check the helper really removes the network, not just that tasks pass.
    task = TASKS[0]
    work = _fresh_trial(task, tmp_path)
    result = _sandbox(task, work, "cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["lo"]


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


@pytest.mark.parametrize(
    ("name", "command", "expected"), NEAR_MISSES, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(NEAR_MISSES)]
)
def test_near_miss_rewards(name: str, command: str, expected: float, tmp_path: Path) -> None:
    task = next(t for t in TASKS if t.name == name)
    work = _fresh_trial(task, tmp_path)
    _sandbox(task, work, command)  # its exit status is irrelevant: only the resulting /app is scored
    assert _verify(task, work) == expected
