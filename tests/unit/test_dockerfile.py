"""What a Dockerfile needs from the Docker engine (its FROM images), and which of an image's dirs a trial may
write (the one holding its WORKDIR, copied per trial) or only read."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpoflow.dockerfile import base_images, docker_engine_problem
from grpoflow.embedded.sandbox.rootfs import image_base


@pytest.mark.parametrize(
    ("dockerfile", "images"),
    [
        ("FROM debian:bookworm-slim\nRUN true\n", [(1, "debian:bookworm-slim")]),
        ("# c\nFROM --platform=linux/amd64 ubuntu:24.04 AS build\nFROM build\nFROM scratch\n", [(2, "ubuntu:24.04")]),
        ("FROM a AS one\nFROM b\nCOPY --from=one /x /x\n", [(1, "a"), (2, "b")]),
    ],
)
def test_base_images_are_the_from_lines_that_name_an_image(dockerfile: str, images: list) -> None:
    assert base_images(dockerfile) == images


def test_no_engine_at_a_dead_socket_is_one_line(no_docker_engine: None) -> None:
    problem = docker_engine_problem()
    assert problem is not None and "\n" not in problem


def test_the_workdirs_top_dir_is_per_trial_and_the_rest_read_only(tmp_path: Path) -> None:
    for name in ("usr", "etc", "var", "workspace", "tmp", "root", "proc", "opt"):
        (tmp_path / name).mkdir()
    (tmp_path / "bin").symlink_to("usr/bin")
    (tmp_path / ".dockerenv").write_text("")
    base = image_base(tmp_path, "/workspace/sub")
    assert base.seeded == ("/workspace",)
    assert base.ro_dirs == ("/etc", "/opt", "/usr", "/var")  # never /tmp, /root, /proc: those are the trial's
    assert "/var" in base.not_trial_paths and "/workspace" not in base.not_trial_paths
    with pytest.raises(ValueError, match="read-only"):
        image_base(tmp_path, "/usr/src/app")
