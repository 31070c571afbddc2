"""Task environments side by side: the bubblewrap sandbox on the host rootfs (every built-in task), the same
sandbox on a Dockerfile-built image's exported tree (what the local sandbox does for such tasks), and, for the
design choice, plain `docker run --network none` of the same image.

    .venv/bin/python bench/sandbox_env.py [--trials 16] [--concurrency 1 4 16] [--no-baseline]

Per environment: trial start latency (start() up to the first command's answer, one at a time; median),
trials/s at each concurrency (a trial = start, two commands, stop and delete), the machine's memory in use at the
highest concurrency (peak proportional set size of the processes the trials run as, sampled every 20 ms: bwrap
and what runs in it; the containers, under their containerd-shim, and the docker CLI calls; not dockerd itself)
and the trial dir's disk use. For
the image: its build time cold (`docker build` with no layer cached, apt and pip from the network, plus the
export) and cached (the digest's lookup). The dataset gate's cost per task (oracle + no-op, image cached) on each.
Needs a Docker engine and the base image: scripts/docker-env.sh.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harbor.utils.logger  # noqa: E402
from harbor.models.task.task import Task  # noqa: E402
from harbor.models.trial.paths import TrialPaths  # noqa: E402

import flows  # noqa: E402, F401  (the offline environment, before Harbor loads)
from bench.main_job import hf_generate_tok_s  # noqa: E402
from grpoflow.config import parse_run_config  # noqa: E402
from grpoflow.embedded.sandbox.images import task_image  # noqa: E402
from grpoflow.embedded.sandbox.local import LocalSandbox  # noqa: E402
from grpoflow.prepare.dataset import builtin_dataset_path, load_dataset  # noqa: E402
from grpoflow.prepare.model import prepare_model  # noqa: E402
from grpoflow.scoring.gate import run_gate  # noqa: E402

harbor.utils.logger.logger.setLevel("WARNING")
REPO = Path(__file__).resolve().parents[1]
DOCKER_TASK = REPO / "tests" / "integration" / "docker" / "tasks" / "csv-total"
HOST_TASK = builtin_dataset_path() / "hello-file"


def sandbox(task_dir: Path, work: Path, images: Path, n: int) -> LocalSandbox:
    task = Task(task_dir)
    paths = TrialPaths(work / f"trial-{n}")
    paths.mkdir()
    return LocalSandbox(
        environment_dir=task.paths.environment_dir,
        environment_name=task_dir.name,
        session_id=f"bench-{n}",
        trial_paths=paths,
        task_env_config=task.config.environment,
        work_dir=str(work / "sandboxes"),
        image_cache_dir=str(images),
        base_images={},
    )


async def bwrap_trial(task_dir: Path, work: Path, images: Path, n: int) -> tuple[float, int]:
    """(seconds to the first command's answer, trial dir bytes); the trial is stopped and deleted."""
    env = sandbox(task_dir, work, images, n)
    t0 = time.perf_counter()
    await env.start(force_build=False)
    await env.exec("ls > /dev/null")
    first = time.perf_counter() - t0
    await env.exec("echo done > /tmp/out && cat /tmp/out > /dev/null")
    assert env._root is not None
    size = int(subprocess.run(["du", "-sb", str(env._root)], capture_output=True, text=True).stdout.split()[0])
    await env.stop(delete=True)
    return first, size


async def docker_trial(tag: str, n: int) -> tuple[float, int]:
    """The same trial as one container: `docker run --network none`, two commands through `docker exec`."""
    name = f"grpoflow-bench-{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    await _sh("docker", "run", "-d", "--rm", "--network", "none", "--name", name, tag, "sleep", "600")
    await _sh("docker", "exec", name, "sh", "-c", "ls > /dev/null")
    first = time.perf_counter() - t0
    await _sh("docker", "exec", name, "sh", "-c", "echo done > /tmp/out && cat /tmp/out > /dev/null")
    await _sh("docker", "rm", "-f", name)
    return first, 0


async def _sh(*argv: str) -> None:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} failed: {err.decode().strip()}")


async def throughput(make, trials: int, concurrency: int) -> float:
    gate = asyncio.Semaphore(concurrency)

    async def one(n: int) -> None:
        async with gate:
            await make(n)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(n) for n in range(trials)))
    return trials / (time.perf_counter() - t0)


def _stat(pid: str) -> tuple[str, int]:
    """(command name, parent pid) of a live process."""
    text = Path(f"/proc/{pid}/stat").read_text()
    name, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
    return name, int(rest[1])


def trial_processes_pss() -> int:
    """Bytes of proportional set size of the processes trials run as: this process's descendants (bwrap and
    everything under it; the docker CLI calls) and those of every containerd-shim (the containers)."""
    parents: dict[int, int] = {}
    roots = {os.getpid()}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                name, ppid = _stat(entry.name)
            except (FileNotFoundError, ProcessLookupError, ValueError):
                continue  # gone since the listing
            parents[int(entry.name)] = ppid
            if name.startswith("containerd-shim"):
                roots.add(int(entry.name))
    total, ours = 0, Path("/proc/self/cmdline").read_bytes()
    for pid in parents:
        p, hops = pid, 0
        while p not in roots and p in parents and hops < 64:
            p, hops = parents[p], hops + 1
        if p in roots and pid != os.getpid():
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes() == ours:
                    continue  # a fork of this process on its way to exec: its pages are this process's
                for line in Path(f"/proc/{pid}/smaps_rollup").open():
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
    return total


def peak_memory(make, trials: int, concurrency: int) -> int:
    """Peak bytes of the trials' processes at `concurrency`, sampled every 20 ms (a run of its own: the sampling
    takes CPU the trials/s runs should not lose)."""
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], trial_processes_pss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        asyncio.run(throughput(make, trials, concurrency))
    finally:
        done.set()
        sampler.join()
    return peak[0]


def build_times(work: Path) -> tuple[float, float]:
    """(cold, cached) seconds: a copy of the task's environment/ whose first RUN line is new, so no layer is
    cached (apt and pip run), built and exported; then the same lookup again."""
    env = work / "cold-env"
    shutil.copytree(DOCKER_TASK / "environment", env)
    text = (env / "Dockerfile").read_text()
    (env / "Dockerfile").write_text(text.replace("\nRUN ", f"\nRUN echo {uuid.uuid4().hex} && ", 1))
    t0 = time.perf_counter()
    image = task_image(env, work / "cold-images")
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = task_image(env, work / "cold-images")
    cached = time.perf_counter() - t0
    assert image.built and not again.built
    subprocess.run(["docker", "rmi", "-f", image.tag], capture_output=True)
    return cold, cached


def gate_per_task(task_dir: Path, work: Path, images: Path) -> float:
    root = work / f"gate-{task_dir.name}"
    shutil.copytree(task_dir, root / task_dir.name)
    rollout = parse_run_config({"rollout": {"sandbox": {"kwargs": {"image_cache_dir": str(images)}}}}).rollout
    t0 = time.perf_counter()
    dataset = load_dataset(root, local_sandbox=True, build_images=True)
    report = run_gate(dataset, rollout, work / f"gate-cache-{task_dir.name}")
    assert [t.verdict for t in report.tasks] == ["verified"], report.tasks
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=16, help="trials per concurrency setting")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--no-baseline", action="store_true")
    args = p.parse_args(argv)
    setup = subprocess.run([str(REPO / "scripts" / "docker-env.sh")], capture_output=True, text=True)
    if setup.returncode != 0:
        raise SystemExit(f"bench/sandbox_env.py needs Docker: {setup.stderr.strip()}")
    if not args.no_baseline:
        model = prepare_model("smollm2-135m-instruct").path
        print(f"baseline: HF generate {hf_generate_tok_s(model):.1f} tok/s on one thread", flush=True)
    work = Path(tempfile.mkdtemp(prefix="grpoflow-sandbox-env-"))
    images = work / "images"
    try:
        cold, cached = build_times(work)
        print(f"image build: cold {cold:.1f} s (docker build, apt + pip, export), cached {cached * 1000:.1f} ms")
        tag = task_image(DOCKER_TASK / "environment", images).tag  # warm for the trials below
        kinds = {
            "bwrap, host rootfs": lambda n: bwrap_trial(HOST_TASK, work, images, n),
            "bwrap, image tree": lambda n: bwrap_trial(DOCKER_TASK, work, images, n),
            "docker run": lambda n: docker_trial(tag, n),
        }
        rows: dict[str, list[str]] = {}
        for label, make in kinds.items():
            firsts = [asyncio.run(make(10_000 + i)) for i in range(5)]
            latency = statistics.median(f for f, _ in firsts) * 1000
            rates = [asyncio.run(throughput(make, args.trials, c)) for c in args.concurrency]
            memory = peak_memory(make, args.trials, args.concurrency[-1]) / 1e6
            disk = statistics.median(s for _, s in firsts) / 1e6
            rows[label] = [f"{latency:.0f} ms", *(f"{r:.1f}" for r in rates), f"{memory:.0f} MB", f"{disk:.1f} MB"]
        c_max = args.concurrency[-1]
        head = [
            "environment",
            "start latency",
            *(f"trials/s c={c}" for c in args.concurrency),
            f"memory c={c_max}",
            "trial dir",
        ]
        widths = [max(len(head[0]), *map(len, rows))] + [max(len(h), 9) for h in head[1:]]
        print("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
        for label, cells in rows.items():
            print("  ".join(c.ljust(w) for c, w in zip([label, *cells], widths, strict=True)))
        for label, task in (("host rootfs", HOST_TASK), ("image tree", DOCKER_TASK)):
            print(f"gate cost per task ({label}, oracle + no-op): {gate_per_task(task, work, images):.1f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
