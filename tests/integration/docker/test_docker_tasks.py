"""Tasks whose environment is built from their Dockerfile (issue 31): through prepare's dataset gate, the oracle of
a task in Harbor's real format (apt and pip packages, data COPY'd into /workspace, ENV, WORKDIR, a pytest verifier)
scores 1.0 and a no-op 0.0; the build is cached by the build context's digest; a broken Dockerfile is a sandbox
failure of that task with the builder's last lines; a FROM image not on this machine, or no Docker engine at all,
is refused at prepare in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from grpoflow.config import parse_run_config
from grpoflow.embedded.sandbox.images import image_key, task_image
from grpoflow.errors import DatasetError
from grpoflow.prepare.dataset import load_dataset
from grpoflow.rollout.environments import ImageBuildError
from grpoflow.run.start import prepare_run
from tests.integration.docker.conftest import DOCKER_TASK

pytestmark = pytest.mark.flow


def _cfg(tmp_path: Path, model: Path, dataset: Path, run_id: str, image_cache: Path):
    return parse_run_config(
        {
            "run_id": run_id,
            "output_dir": str(tmp_path / "runs"),
            "model": {"source": str(model)},
            "dataset": {"path": str(dataset), "build_images": True},
            "rollout": {"sandbox": {"retries": 1, "kwargs": {"image_cache_dir": str(image_cache)}}},
        }
    )


def _broken(root: Path) -> None:
    """The good task with a Dockerfile whose RUN fails."""
    task = shutil.copytree(root / DOCKER_TASK, root / "broken-build")
    (task / "environment" / "Dockerfile").write_text(
        "FROM debian:bookworm-slim\nRUN echo compiling the toolchain && no-such-compiler --version\n"
    )


def test_oracle_scores_one_and_nop_zero_through_prepare_and_the_build_is_cached(
    tmp_path, tiny_model_dir, docker_ready, docker_tasks, capsys
):
    _broken(docker_tasks)
    images = tmp_path / "images"  # cold for this test: the build and the export run here
    t0 = time.perf_counter()
    run = prepare_run(_cfg(tmp_path, tiny_model_dir, docker_tasks, "docker-1", images), cache_dir=tmp_path / "c1")
    first_s = time.perf_counter() - t0
    gate = {t["name"]: t for t in json.loads(run.paths.gate.read_text())["tasks"]}
    good, broken = gate[DOCKER_TASK], gate["broken-build"]
    assert (good["verdict"], good["oracle_reward"], good["nop_reward"]) == ("verified", 1.0, 0.0)
    # a build failure gives no sandbox for any trial of the task: left out, with the builder's last lines
    assert broken["verdict"] == "environment-fails" and not broken["admitted"], broken
    assert broken["oracle_reward"] is None and "ImageBuildError" in broken["reason"], broken["reason"]
    assert "no-such-compiler: not found" in broken["reason"]
    # the build log stays in the image cache (the gate's trials run before the run dir exists)
    digest = image_key(docker_tasks / DOCKER_TASK / "environment")
    log = images / f"{digest}.build.log"
    assert "Successfully tagged grpoflow-env:" in log.read_text()

    # a second prepare (fresh gate cache, so its trials run again) builds nothing: the image comes from the cache
    built_at = log.stat().st_mtime
    t0 = time.perf_counter()
    again = prepare_run(_cfg(tmp_path, tiny_model_dir, docker_tasks, "docker-2", images), cache_dir=tmp_path / "c2")
    second_s = time.perf_counter() - t0
    gate2 = {t["name"]: t for t in json.loads(again.paths.gate.read_text())["tasks"]}
    assert gate2[DOCKER_TASK]["verdict"] == "verified" and not gate2[DOCKER_TASK]["cached"]
    assert log.stat().st_mtime == built_at
    t0 = time.perf_counter()
    cached = task_image(docker_tasks / DOCKER_TASK / "environment", images)
    lookup_s = time.perf_counter() - t0
    assert not cached.built and lookup_s < 1.0
    print(f"docker gate: first prepare {first_s:.1f} s (build), second {second_s:.1f} s, cached image {lookup_s:.3f} s")
    prompts = [json.loads(line)["instance_id"] for line in run.paths.prompts.read_text().splitlines()]
    assert DOCKER_TASK in prompts


CORPUS_BASE = "ghcr.io/laude-institute/t-bench/ubuntu-24-04:latest"  # the public corpus's FROM


def test_a_from_image_not_here_and_not_pulled_is_refused_in_one_line_until_base_images_maps_it(
    docker_ready, docker_tasks
):
    dockerfile = docker_tasks / DOCKER_TASK / "environment" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text().replace("debian:bookworm-slim", CORPUS_BASE))
    with pytest.raises(DatasetError) as info:
        load_dataset(docker_tasks, local_sandbox=True, build_images=True)
    reason = str(info.value)
    assert "\n" not in reason and str((docker_tasks / DOCKER_TASK).resolve()) in reason
    # the pull was tried (no registry answers here) and the way out is named
    assert f"environment/Dockerfile:3: FROM {CORPUS_BASE}: not on this machine's Docker engine and not pulled (" in (
        reason
    )
    assert "map it to a local image with dataset.base_images" in reason
    # mapped to an image that is not here either: that says so
    with pytest.raises(DatasetError, match=r"dataset.base_images maps it to grpoflow-test/absent:1, which is not"):
        load_dataset(docker_tasks, local_sandbox=True, base_images={CORPUS_BASE: "grpoflow-test/absent:1"})
    # mapped to the Debian base built here: admitted, the resolved base recorded with the task
    [task] = load_dataset(docker_tasks, local_sandbox=True, base_images={CORPUS_BASE: "debian:bookworm-slim"}).tasks
    [base] = task.bases
    assert (base.line, base.reference, base.image) == (3, CORPUS_BASE, "debian:bookworm-slim")
    assert base.id == _image_id("debian:bookworm-slim")


def _image_id(name: str) -> str:
    return subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", name], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_a_mapped_base_builds_from_its_image_and_a_moved_base_tag_rebuilds(docker_ready, tmp_path):
    moving = "grpoflow-test/moving-base:latest"
    env = tmp_path / "task" / "environment"
    env.mkdir(parents=True)
    (env / "Dockerfile").write_text(f"FROM {CORPUS_BASE} AS base\nRUN cat /base-mark > /seen\n")
    images = tmp_path / "images"
    try:
        for mark in ("first", "second"):
            # the tag a mapping names moves to another image (as `latest` does when a base is rebuilt)
            subprocess.run(
                ["docker", "build", "-q", "-t", moving, "-"],
                input=f"FROM debian:bookworm-slim\nRUN echo {mark} > /base-mark\n",
                text=True,
                check=True,
                capture_output=True,
            )
            image = task_image(env, images, base_images={CORPUS_BASE: moving})
            assert image.built, mark  # a new base ID is a new cache key: built again
            assert (image.rootfs / "seen").read_text() == f"{mark}\n"
            assert [(b.reference, b.image, b.id) for b in image.bases] == [(CORPUS_BASE, moving, _image_id(moving))]
            log = image.build_log.read_text()
            assert log.startswith(f"# base: FROM {CORPUS_BASE} -> {moving} ({_image_id(moving)})")
            assert not task_image(env, images, base_images={CORPUS_BASE: moving}).built  # same base: cached
    finally:
        subprocess.run(["docker", "rmi", "-f", moving], capture_output=True)


def test_without_a_docker_engine_the_task_is_refused_in_one_line(no_docker_engine, docker_tasks):
    with pytest.raises(DatasetError) as info:
        load_dataset(docker_tasks, local_sandbox=True, build_images=True)
    reason = str(info.value)
    assert "\n" not in reason and str((docker_tasks / DOCKER_TASK).resolve()) in reason
    assert "environment/Dockerfile:4: `RUN apt-get update" in reason and "no Docker engine answers" in reason


def test_a_dataset_s_dockerfiles_are_built_when_an_engine_answers_unless_the_run_says_no(docker_ready, docker_tasks):
    # the default (empty) builds with the engine that answers; false keeps the host rootfs alone
    assert [t.name for t in load_dataset(docker_tasks, local_sandbox=True).tasks] == [DOCKER_TASK]
    with pytest.raises(DatasetError) as info:
        load_dataset(docker_tasks, local_sandbox=True, build_images=False)
    reason = str(info.value)
    assert "environment/Dockerfile:4: `RUN apt-get update" in reason and "\n" not in reason
    assert reason.endswith("dataset.build_images=true builds it with Docker")


def test_a_dockerfile_the_builder_cannot_parse_fails_with_the_parser_s_line_not_its_notices(docker_ready, tmp_path):
    env = tmp_path / "environment"
    env.mkdir()
    # a COPY heredoc: BuildKit's syntax, which this engine's legacy builder does not parse (a RUN one is rewritten)
    (env / "Dockerfile").write_text("FROM debian:bookworm-slim\nCOPY <<'EOF' /x.yml\nname: CI\nEOF\n")
    with pytest.raises(ImageBuildError) as info:
        task_image(env, tmp_path / "images")
    assert "dockerfile parse error line 3: unknown instruction: NAME:" in str(info.value)
    assert "DEPRECATED" not in str(info.value) and "# base:" not in str(info.value)


def test_a_run_heredoc_builds_on_the_legacy_builder_as_buildkit_runs_it(docker_ready, tmp_path):
    env = tmp_path / "environment"
    env.mkdir()
    # As corpus tasks write files: a heredoc after a command, a bare one, and a body line that reads like an
    # instruction (never a second base image).
    (env / "Dockerfile").write_text(
        "FROM debian:bookworm-slim\n"
        "RUN cat > /ci.yml << 'EOF'\nname: CI\nFROM nowhere:1\n  run: echo \"$HOME\"\nEOF\n"
        "RUN <<EOF\nset -e\necho bare > /bare.txt\nEOF\n"
        "WORKDIR /app\n"
    )
    image = task_image(env, tmp_path / "images")
    assert (image.rootfs / "ci.yml").read_text() == 'name: CI\nFROM nowhere:1\n  run: echo "$HOME"\n'
    assert (image.rootfs / "bare.txt").read_text() == "bare\n"
    assert [b.reference for b in image.bases] == ["debian:bookworm-slim"]
