"""What a Dockerfile needs from the Docker engine (its FROM images), and which of an image's dirs a trial may
write (the one holding its WORKDIR, copied per trial) or only read."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpoflow.dockerfile import BaseImage, UnresolvedBaseImage, docker_engine_problem, from_images, pinned_dockerfile
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
    assert from_images(dockerfile) == images


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


def test_a_pinned_dockerfile_names_each_from_image_by_the_id_it_resolved_to() -> None:
    text = "# base\nFROM --platform=linux/amd64 ghcr.io/x/ubuntu:24.04 AS build\nRUN make\nFROM build\nFROM debian:12\n"
    bases = [
        BaseImage(2, "ghcr.io/x/ubuntu:24.04", "debian:bookworm-slim", "sha256:aaa"),
        BaseImage(5, "debian:12", "debian:12", "sha256:bbb"),
    ]
    assert [(line, ref) for line, ref in from_images(text)] == [(2, "ghcr.io/x/ubuntu:24.04"), (5, "debian:12")]
    assert pinned_dockerfile(text, bases) == (
        "# base\nFROM --platform=linux/amd64 sha256:aaa AS build\nRUN make\nFROM build\nFROM sha256:bbb\n"
    )
    continued = "FROM \\\n  debian:12\n"
    with pytest.raises(UnresolvedBaseImage, match="write the FROM instruction on one line"):
        pinned_dockerfile(continued, [BaseImage(1, "debian:12", "debian:12", "sha256:bbb")])
