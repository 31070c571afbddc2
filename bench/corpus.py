"""A sample of a Harbor task corpus (e.g. github.com/zjysteven/terminal-bench-env's `environments_harbor/`, 3,566
Terminal-Bench tasks, fetched by the user) through what prepare does with it on this machine: the dataset loader
(refusals), each task's image built with the local Docker engine (its `FROM` base mapped by `dataset.base_images`
to the Debian one built here), then the dataset gate in the bubblewrap sandbox on the image.

    .venv/bin/python bench/corpus.py DIR [--sample 20] [--seed 0] [--map-prefix PREFIX=IMAGE ...]
        [--base REF=IMAGE ...] [--concurrency 2] [--no-baseline]

`--map-prefix` maps every `FROM` reference starting with PREFIX to IMAGE (default: the corpus's Terminal-Bench
Ubuntu 24.04 base to `debian:bookworm-slim`); `--base` maps one reference exactly. Per task: build seconds (cold,
or the cache's lookup), the gate's verdict and its reason; in total: tasks refused at load, built, admitted and left
out by verdict. The aim: every task either runnable or left out for a reason that is the corpus's (e.g. a package
Debian lacks), none for a limit of ours. Needs a Docker engine and the base image: scripts/docker-env.sh.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flows  # noqa: E402, F401  (the offline environment, before Harbor loads)
from bench.main_job import hf_generate_tok_s  # noqa: E402
from grpoflow.config import parse_run_config  # noqa: E402
from grpoflow.dockerfile import from_images  # noqa: E402
from grpoflow.embedded.sandbox.images import task_image  # noqa: E402
from grpoflow.errors import DatasetError, one_line  # noqa: E402
from grpoflow.prepare.dataset import load_dataset  # noqa: E402
from grpoflow.prepare.model import prepare_model  # noqa: E402
from grpoflow.rollout.environments import ImageBuildError  # noqa: E402
from grpoflow.scoring.gate import GateSettings, run_gate  # noqa: E402

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("corpus", type=Path, help="a dir of Harbor task dirs")
    ap.add_argument("--sample", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--map-prefix", action="append", default=[], metavar="PREFIX=IMAGE")
    ap.add_argument("--base", action="append", default=[], metavar="REF=IMAGE")
    ap.add_argument("--concurrency", type=int, default=2, help="gate trials at once")
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
        rollout = parse_run_config(
            {
                "rollout": {
                    "concurrency": args.concurrency,
                    "sandbox": {"retries": 1, "kwargs": {"image_cache_dir": str(images)}},
                }
            }
        ).rollout
        report = run_gate(
            dataset,
            rollout,
            work / "cache",
            settings=GateSettings(base_images=mapping, fresh=True),
            progress=lambda line: print(line, flush=True),
        )
        print("\n| task | built (s) | gate verdict | reason |\n|---|---|---|---|")
        for t in report.tasks:
            reason = one_line(t.reason or "", 160).replace("|", "/")
            print(f"| {t.name} | {built.get(t.name, '-')} | {t.verdict} | {reason} |")
        verdicts = Counter(t.verdict for t in report.tasks)
        n_built = sum(v not in ("failed",) for v in built.values())
        print(
            f"\n{len(tasks)} tasks: {len(dataset.left_out)} refused at load, {n_built} built, "
            f"{sum(t.admitted for t in report.tasks)} admitted; verdicts {dict(sorted(verdicts.items()))}; "
            f"gate {report.trials_run} trials in {report.seconds:.0f} s"
        )
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
