"""What a Dockerfile needs from the Docker engine (its FROM images), and which of an image's dirs a trial may
write (the one holding its WORKDIR, copied per trial) or only read."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpoflow.dockerfile import (
    BaseImage,
    UnresolvedBaseImage,
    docker_engine_problem,
    dockerfile_instructions,
    from_images,
    legacy_run_heredocs,
    pinned_dockerfile,
)
from grpoflow.embedded.sandbox.rootfs import Account, Base, BaseTreeError, account_files, image_account, image_base


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


def test_an_image_s_dirs_are_the_trial_s_but_usr_and_etc(tmp_path: Path) -> None:
    for name in ("usr", "etc", "var", "workspace", "tmp", "root", "proc", "opt"):
        (tmp_path / name).mkdir()
    (tmp_path / "bin").symlink_to("usr/bin")
    (tmp_path / ".dockerenv").write_text("")
    base = image_base(tmp_path, "/workspace/sub")
    assert base.writable == ("/opt", "/root", "/tmp", "/var", "/workspace")  # never /proc: the kernel's
    assert base.ro_dirs == ("/etc", "/usr")
    assert "/etc" in base.not_trial_paths and "/var" not in base.not_trial_paths
    assert base.account == Account()  # no USER: the sandbox account, home /root
    with pytest.raises(ValueError, match="read-only"):
        image_base(tmp_path, "/usr/src/app")


def test_an_image_s_user_is_looked_up_as_docker_does_and_takes_the_trial_s_uid(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/bash\nbuilder:x:1000:1000::/home/builder:/bin/sh\n"
    )
    (tmp_path / "etc" / "group").write_text("root:x:0:\nbuilder:x:1000:\nstaff:x:50:builder\n")
    for spec in ("builder", "1000", "builder:staff", "1000:1000"):
        assert image_account(tmp_path, spec) == Account("builder", "/home/builder", in_image=True), spec
    for spec in (None, "", "root", "0", "0:0"):
        assert image_account(tmp_path, spec) == Account(), spec
    assert image_account(tmp_path, "4242") == Account("sandbox", "/")  # a uid without an entry: home /
    with pytest.raises(BaseTreeError, match="the image's USER ghost is not in its /etc/passwd"):
        image_account(tmp_path, "ghost")
    files = account_files(Base(tmp_path, (), (), image_account(tmp_path, "builder")), 70123)
    assert "builder:x:70123:70123::/home/builder:/bin/sh\n" in files["passwd"]
    assert files["group"] == "root:x:0:\nbuilder:x:70123:\nstaff:x:50:builder\n"  # its private group
    plain = account_files(Base(tmp_path, (), ()), 70123)
    assert plain["passwd"].endswith(
        "builder:x:1000:1000::/home/builder:/bin/sh\nsandbox:x:70123:70123:sandbox:/root:/bin/bash\n"
    )
    assert plain["group"].endswith("sandbox:x:70123:\n")
    (tmp_path / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\napp:x:1001:0::/opt/app:/bin/sh\n")
    shared = account_files(Base(tmp_path, (), (), image_account(tmp_path, "app")), 70123)  # `useradd -g 0`
    assert "app:x:70123:70123::/opt/app:/bin/sh\n" in shared["passwd"]
    assert shared["group"].startswith("root:x:0:\n") and shared["group"].endswith("app:x:70123:\n")


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


HEREDOCS = """\
FROM debian:bookworm-slim
RUN cat > /a.py << 'EOF'
#!/usr/bin/env python3
FROM evil:1
EOF
RUN <<-X cat > /b.txt
	indented
	X
RUN <<EOF
echo bare
EOF
RUN <<EOF
#!/usr/bin/env python3
print(1)
EOF
COPY <<EOF /c.txt
c
EOF
WORKDIR /app
"""


def test_a_heredoc_s_lines_belong_to_its_instruction() -> None:
    found = dockerfile_instructions(HEREDOCS)
    assert [(line, keyword) for line, keyword, _ in found] == [
        (1, "FROM"),
        (2, "RUN"),
        (6, "RUN"),
        (9, "RUN"),
        (12, "RUN"),
        (16, "COPY"),
        (19, "WORKDIR"),
    ]
    assert found[1][2] == "cat > /a.py << 'EOF'\n#!/usr/bin/env python3\nFROM evil:1\nEOF"
    assert from_images(HEREDOCS) == [(1, "debian:bookworm-slim")]  # a body line is never a base image


def test_run_heredocs_become_the_shell_running_the_same_script() -> None:
    legacy = legacy_run_heredocs(HEREDOCS).splitlines()
    assert legacy[1] == """RUN ["/bin/sh", "-c", "cat > /a.py << 'EOF'\\n#!/usr/bin/env python3\\nFROM evil:1\\nEOF"]"""
    assert legacy[2] == 'RUN ["/bin/sh", "-c", "<<-X cat > /b.txt\\n\\tindented\\n\\tX"]'
    assert legacy[3] == 'RUN ["/bin/sh", "-c", "echo bare"]'  # bare: the body is the script
    # a bare heredoc naming its interpreter, and COPY's: as written, for the builder to refuse in its own words
    assert legacy[4:8] == ["RUN <<EOF", "#!/usr/bin/env python3", "print(1)", "EOF"]
    assert legacy[8:] == ["COPY <<EOF /c.txt", "c", "EOF", "WORKDIR /app"]
    shell = 'SHELL ["/bin/bash", "-euo", "pipefail", "-c"]\n'
    assert legacy_run_heredocs(shell + "RUN <<EOF\necho x\nEOF\n").splitlines()[1] == (
        'RUN ["/bin/bash", "-euo", "pipefail", "-c", "echo x"]'
    )
    assert legacy_run_heredocs("FROM a\nRUN echo plain\n") == "FROM a\nRUN echo plain\n"


@pytest.mark.parametrize(
    "run",
    [
        "RUN tr a-z A-Z <<< hello",  # a here-string
        "RUN echo $((1<<3))",  # a shift
        'RUN ["sh", "-c", "cat <<EOF"]',  # the exec form
    ],
)
def test_what_only_looks_like_a_heredoc_takes_no_lines(run: str) -> None:
    text = f"FROM a\n{run}\nFROM b AS c\nCOPY x /x\n"
    assert [keyword for _, keyword, _ in dockerfile_instructions(text)] == ["FROM", "RUN", "FROM", "COPY"]
    assert from_images(text) == [(1, "a"), (3, "b")]
    assert legacy_run_heredocs(text) == text


def test_a_run_heredoc_with_buildkit_flags_is_left_for_the_builder() -> None:
    text = "FROM a\nRUN --mount=type=cache,target=/c <<EOF\necho x\nEOF\n"
    assert legacy_run_heredocs(text) == text
