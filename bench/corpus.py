"""A sample of a Harbor task corpus (e.g. github.com/zjysteven/terminal-bench-env's `environments_harbor/`, 3,566
Terminal-Bench tasks, fetched by the user) through what a user's run does with it on this machine: the dataset
loader (refusals), each task's image built with the local Docker engine (its `FROM` base mapped by
`dataset.base_images` to the Debian one built here), then `grpoflow evaluate --split all` with the embedded model:
prepare and its dataset gate, then trials of every admitted task in the bubblewrap sandbox on its image.

    .venv/bin/python bench/corpus.py DIR [--sample 20] [--seed 0] [--map-prefix PREFIX=IMAGE ...]
        [--base REF=IMAGE ...] [--concurrency 2] [--samples-per-task 1] [--image-cache DIR] [--no-baseline]

`--map-prefix` maps every `FROM` reference starting with PREFIX to IMAGE (default: the corpus's Terminal-Bench
Ubuntu 24.04 base to `debian:bookworm-slim`); `--base` maps one reference exactly. Per task: build seconds (cold,
or the cache's lookup), the gate's verdict, and over its evaluation trials: the sandbox's start (ms, Harbor's
environment setup), the trial's wall time, its peak memory (the trial's cgroup), its reward or failure, and the
reason a task was left out. In total: tasks refused at load, built, runnable (admitted, trials complete) and left
out by verdict. The aim: every task either runnable or left out for a reason that is the corpus's (e.g. a package
Debian lacks), none for a limit of ours. Needs a Docker engine and the base image: scripts/docker-env.sh. Gate
verdicts are cached as in any run (in $GRPOFLOW_CACHE): a second sample of the same tasks reuses them.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import flows  # noqa: E402, F401  (the offline environment, before Harbor loads)
from bench.main_job import hf_generate_tok_s  # noqa: E402
from grpoflow.dockerfile import from_images  # noqa: E402
from grpoflow.embedded.sandbox.images import task_image  # noqa: E402
from grpoflow.errors import DatasetError, one_line  # noqa: E402
from grpoflow.prepare.dataset import load_dataset  # noqa: E402
from grpoflow.prepare.model import prepare_model  # noqa: E402
from grpoflow.rollout.environments import ImageBuildError  # noqa: E402

if TYPE_CHECKING:
    from harbor.models.trial.result import TimingInfo, TrialResult

CORPUS_BASE_PREFIX = "ghcr.io/laude-institute/t-bench/ubuntu-24-04"


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise SystemExit(f"corpus.py: {what} {item!r}: write KEY=IMAGE")
        out[key] = value
    return out


def sample_tasks(corpus: Path, n: int, seed: int, dest: Path) -> list[Path]:
    """`n` task dirs of `corpus` drawn with `seed`, copied under `dest` (the loader refuses links from outside)."""
    dirs = sorted(p for p in corpus.iterdir() if (p / "task.toml").is_file())
    if not dirs:
        raise SystemExit(f"corpus.py: {corpus} holds no task dirs (task.toml)")
    picked = random.Random(seed).sample(dirs, min(n, len(dirs)))
    return [Path(shutil.copytree(d, dest / d.name, symlinks=True)) for d in sorted(picked)]


def base_mapping(tasks: list[Path], prefixes: dict[str, str], exact: dict[str, str]) -> dict[str, str]:
    mapping = dict(exact)
    for task in tasks:
        dockerfile = task / "environment" / "Dockerfile"
        if not dockerfile.is_file():
            continue
        for _, ref in from_images(dockerfile.read_text(encoding="utf-8", errors="replace")):
            for prefix, image in prefixes.items():
                if ref.startswith(prefix) and ref not in mapping:
                    mapping[ref] = image
    return mapping


def evaluate(root: Path, runs: Path, mapping: dict[str, str], images: Path, args: argparse.Namespace) -> Path:
    """`grpoflow evaluate --split all` over the sample, as a user runs it; its run dir."""
    run_id = f"corpus-seed{args.seed}"
    sets = {
        "dataset.build_images": "true",
        "dataset.base_images": json.dumps(mapping),
        "rollout.sandbox.kwargs.image_cache_dir": str(images),
        "rollout.concurrency": str(args.concurrency),
        "train.eval.samples_per_prompt": str(args.samples_per_task),
    }
    argv = [sys.executable, "-m", "flows.cli", "evaluate", "--dataset", str(root), "--split", "all"]
    argv += ["--run-id", run_id, "--output-dir", str(runs)]
    argv += [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    tail = proc.stdout.strip().splitlines()[-3:] + proc.stderr.strip().splitlines()[-3:]
    print(f"grpoflow evaluate: exit {proc.returncode} in {time.perf_counter() - t0:.0f} s; " + " / ".join(tail))
    return runs / run_id


def _seconds(span: TimingInfo | TrialResult | None) -> float | None:
    if span is None or span.started_at is None or span.finished_at is None:
        return None
    return (span.finished_at - span.started_at).total_seconds()


def _attempt(result_file: Path) -> tuple[str, int]:
    """(the trial, its attempt) of a trial dir `<eval dir>/<trial>__a<attempt>/result.json`."""
    name, _, attempt = result_file.parent.name.rpartition("__a")
    return f"{result_file.parent.parent.name}/{name}", int(attempt)


def trial_rows(run_dir: Path) -> dict[str, list[dict]]:
    """Per task: each evaluation trial's sandbox start (s), wall (s), peak memory (MiB) and reward or failure; a
    retried trial by its last attempt."""
    from harbor.models.trial.result import TrialResult  # after `flows`: its offline environment comes first

    last = {_attempt(f)[0]: f for f in sorted(run_dir.glob("trials/eval_*/*/result.json"), key=_attempt)}
    rows: dict[str, list[dict]] = {}
    for result_file in sorted(last.values()):
        result = TrialResult.model_validate_json(result_file.read_text())
        resources = result_file.parent / "sandbox-resources.json"
        used = json.loads(resources.read_text()) if resources.is_file() else {}
        failure = result.exception_info.exception_type if result.exception_info else None
        reward = (result.verifier_result.rewards or {}).get("reward") if result.verifier_result else None
        rows.setdefault(result.task_name, []).append(
            {
                "start": _seconds(result.environment_setup),
                "wall": _seconds(result),
                "peak": used.get("peak_memory_mb"),
                "failed": failure is not None,
                "outcome": failure or (f"reward {reward:g}" if reward is not None else "no reward"),
            }
        )
    return rows


def _fmt(values: list, spec: str, scale: float = 1.0) -> str:
    known = [v * scale for v in values if v is not None]
    return "/".join(format(v, spec) for v in known) if known else "-"


def report(tasks: list[Path], built: dict[str, str], run_dir: Path) -> None:
    gate_file = run_dir / "gate.json"
    if not gate_file.is_file():
        print(f"no {gate_file}: the evaluation failed before its dataset gate (its output is above)")
        return
    gate = json.loads(gate_file.read_text())
    trials = trial_rows(run_dir)
    print(
        "\n| task | built (s) | gate verdict | trial start (ms) | trial wall (s) | peak memory (MiB) | outcome | reason |"
        "\n|---|---|---|---|---|---|---|---|"
    )
    runnable = 0
    for t in gate["tasks"]:
        rows = trials.get(t["name"], [])
        complete = rows and not any(r["failed"] for r in rows)
        runnable += bool(t["admitted"] and complete)
        verdict = t["verdict"] + (" (cached)" if t.get("cached") else "")
        reason = one_line(t.get("reason") or "", 160).replace("|", "/")
        print(
            f"| {t['name']} | {built.get(t['name'], '-')} | {verdict} | {_fmt([r['start'] for r in rows], '.0f', 1000)} "
            f"| {_fmt([r['wall'] for r in rows], '.1f')} | {_fmt([r['peak'] for r in rows], '.0f')} "
            f"| {'; '.join(r['outcome'] for r in rows) or '-'} | {reason} |"
        )
    verdicts = Counter(t["verdict"] for t in gate["tasks"] if not t["admitted"])
    n_built = sum(v != "failed" for v in built.values())
    print(
        f"\n{len(tasks)} tasks: {n_built} built, {runnable} runnable (admitted, evaluation trials complete), "
        f"{len(gate['tasks']) - gate['admitted']} left out {dict(sorted(verdicts.items()))}; "
        f"gate {gate['trials_run']} trials in {gate['seconds']:.0f} s"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("corpus", type=Path, help="a dir of Harbor task dirs")
    ap.add_argument("--sample", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--map-prefix", action="append", default=[], metavar="PREFIX=IMAGE")
    ap.add_argument("--base", action="append", default=[], metavar="REF=IMAGE")
    ap.add_argument("--concurrency", type=int, default=2, help="trials at once (the gate's and the evaluation's)")
    ap.add_argument("--samples-per-task", type=int, default=1, help="evaluation trials per task")
    ap.add_argument("--image-cache", type=Path, help="default: a fresh temp dir (every build cold)")
    ap.add_argument("--no-baseline", action="store_true")
    args = ap.parse_args()
    prefixes = _pairs(args.map_prefix, "--map-prefix") or {CORPUS_BASE_PREFIX: "debian:bookworm-slim"}
    if not args.no_baseline:
        model = prepare_model("smollm2-135m-instruct").path
        print(f"baseline: HF generate {hf_generate_tok_s(model):.1f} tok/s (SmolLM2-135M, one thread)", flush=True)
    work = Path(tempfile.mkdtemp(prefix="grpoflow-corpus-"))
    try:
        root = work / "tasks"
        tasks = sample_tasks(args.corpus.resolve(), args.sample, args.seed, root)
        mapping = base_mapping(tasks, prefixes, _pairs(args.base, "--base"))
        print(f"{len(tasks)} tasks of {args.corpus} (seed {args.seed}); base images: {mapping}", flush=True)
        try:
            dataset = load_dataset(root, local_sandbox=True, build_images=True, base_images=mapping)
        except DatasetError as err:
            print(f"every task refused at load: {one_line(str(err), 400)}")
            return 1
        built: dict[str, str] = {}
        images = args.image_cache or work / "images"
        for i, task in enumerate(dataset.tasks, 1):
            t0 = time.perf_counter()
            try:
                image = task_image(task.path / "environment", images, base_images=mapping)
                built[task.name] = f"{time.perf_counter() - t0:.1f}" + ("" if image.built else " (cached)")
            except ImageBuildError as err:
                built[task.name] = "failed"
                print(f"  build failed: {task.name}: {one_line(str(err), 300)}", flush=True)
            print(f"built {i}/{len(dataset.tasks)}: {task.name}: {built[task.name]} s", flush=True)
        run_dir = evaluate(root, work / "runs", mapping, images, args)
        report(tasks, built, run_dir)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
