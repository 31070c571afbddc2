"""Preflight: every failure message, against local stand-in servers on 127.0.0.1 (no cloud API is reachable here)."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpoflow import preflight
from grpoflow.config import parse_run_config
from grpoflow.preflight import (
    PreflightError,
    check_engine,
    check_harbor,
    check_harbor_environment,
    check_harbor_preflight,
    check_local_sandbox,
    check_run,
    check_sandbox,
    check_sandbox_api,
    format_problems,
)


class StandIn:
    """An HTTP server on 127.0.0.1 answering each path from `routes` (path -> (status, JSON body)), `default`
    otherwise, after `delay_s`. Records (method, path, headers) of every request."""

    def __init__(self, routes=None, default=(200, {}), delay_s=0.0):
        self.routes, self.default, self.delay_s = routes or {}, default, delay_s
        self.requests: list[tuple[str, str, dict]] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                stand_in.requests.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
                time.sleep(stand_in.delay_s)
                status, body = stand_in.routes.get(self.path.split("?")[0], stand_in.default)
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout tests)
                    pass

            do_GET = do_POST = do_DELETE = _answer

            def log_message(self, *args):  # keep test output clean
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stand_in():
    servers = []

    def make(**kw):
        servers.append(StandIn(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def refused_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (a port just bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _e2b(**rollout):
    return parse_run_config({"rollout": {"sandbox": "e2b", **rollout}}).rollout


# ---- local sandbox tools ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "missing, package",
    [
        ("bwrap", "bubblewrap"),
        ("/bin/bash", "bash"),
    ],
)
def test_each_missing_local_tool_names_its_package(missing, package, monkeypatch):
    """Preflight asks the sandbox itself (its Harbor `preflight()`), so it passes no machine the sandbox refuses."""
    import shutil

    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda path: None if path == missing else real(path) or path)
    problems = check_local_sandbox()
    assert len(problems) == 1
    tool = missing.rsplit("/", 1)[-1]
    assert problems[0].startswith(f"rollout.sandbox.backend=local: the local sandbox needs `{tool}`")
    assert f"apt-get install -y {package}" in problems[0] and "rollout.sandbox.backend to" in problems[0]


def test_all_local_tools_missing_lists_all(monkeypatch):
    import shutil

    from grpoflow.embedded.sandbox.processes import HOST_TOOLS, require_tools
    from grpoflow.rollout.environments import SandboxUnavailableError

    monkeypatch.setattr(shutil, "which", lambda path: None)
    assert len(check_local_sandbox()) == len(HOST_TOOLS) == 2
    with pytest.raises(SandboxUnavailableError, match="bash"):  # the sandbox refuses what preflight names
        require_tools()


def test_local_tools_present_here_pass():
    # The machine this suite runs on has them (the sandbox tests need them too).
    assert check_local_sandbox() == [] or pytest.skip("bubblewrap/util-linux not installed here")


# ---- harbor ---------------------------------------------------------------------------------------------------


def test_harbor_not_importable():
    def no_harbor(name):
        raise ModuleNotFoundError("No module named 'harbor'")

    [problem] = check_harbor(import_module=no_harbor)
    assert problem.startswith("harbor is not importable") and "pip install 'harbor==0.25.0'" in problem
    assert check_harbor() == []


def test_harbor_environment_whose_extra_is_missing(monkeypatch):
    from harbor.environments.factory import EnvironmentFactory

    def missing_extra(type, import_path=None):
        raise ImportError(
            "The 'modal' environment requires extra dependencies. Install them with:\n  pip install 'harbor[modal]'"
        )

    monkeypatch.setattr(EnvironmentFactory, "resource_capabilities", missing_extra)
    [problem] = check_harbor_environment("modal")
    assert problem.startswith("rollout.sandbox.backend=modal: Harbor cannot load this environment")
    assert "pip install 'harbor[modal]'" in problem and "\n" not in problem
    # and check_sandbox stops there: no key or API check of an environment that cannot load
    assert check_sandbox(parse_run_config({"rollout": {"sandbox": {"backend": "modal"}}}).rollout, {}) == [problem]


def test_e2b_environment_loads_here():
    assert check_harbor_environment("e2b") == [] or pytest.skip("harbor[e2b] is not fully installed here")


def test_harbor_extra_not_fully_installed(monkeypatch):
    monkeypatch.setattr(preflight, "missing_extra_packages", lambda extra: ["dockerfile-parse"])
    assert check_harbor_environment("e2b") == [
        "rollout.sandbox.backend=e2b: Harbor's `e2b` extra is not fully installed (missing dockerfile-parse): "
        "pip install 'harbor[e2b]==0.25.0'"
    ]


def test_missing_extra_packages_reads_harbors_metadata(monkeypatch):
    from importlib import metadata

    monkeypatch.setattr(
        metadata,
        "requires",
        lambda dist: [
            "e2b>=2.25.0 ; extra == 'e2b'",
            "grpoflow-no-such-package>=1 ; extra == 'e2b'",
            "grpoflow-no-such-package-2 ; extra == 'modal'",
            "harbor[e2b] ; extra == 'cloud'",
            "pydantic>=2",
        ],
    )
    assert preflight.missing_extra_packages("e2b") == ["grpoflow-no-such-package"]


def test_harbor_preflight_exit_message_becomes_a_problem(monkeypatch):
    from harbor.environments.factory import EnvironmentFactory

    def no_docker(type, import_path=None):
        raise SystemExit("Docker is not installed or not on PATH. Please install Docker and try again.")

    monkeypatch.setattr(EnvironmentFactory, "run_preflight", no_docker)
    assert check_harbor_preflight("docker") == [
        "rollout.sandbox.backend=docker: Docker is not installed or not on PATH. Please install Docker and try again."
    ]


def test_harbor_preflight_crash_becomes_a_problem(monkeypatch):
    from harbor.environments.factory import EnvironmentFactory

    def broken(type, import_path=None):
        raise RuntimeError("token file unreadable")

    monkeypatch.setattr(EnvironmentFactory, "run_preflight", broken)
    assert check_harbor_preflight("modal") == [
        "rollout.sandbox.backend=modal: Harbor's preflight failed: RuntimeError: token file unreadable"
    ]


# ---- sandbox credentials --------------------------------------------------------------------------------------


@pytest.mark.parametrize("environ", [{}, {"E2B_API_KEY": ""}, {"E2B_API_KEY": "  \n"}])
def test_missing_or_blank_key_variable(environ, stand_in):
    api = stand_in(default=(401, {}))
    problems = check_sandbox(_e2b(), {**environ, "E2B_API_URL": api.url})
    assert problems == [
        "rollout.sandbox.backend=e2b needs an API key: set E2B_API_KEY in the environment, or set "
        "rollout.sandbox.api_key_file to a file holding it"
    ]


def test_key_file_missing(tmp_path, stand_in):
    api = stand_in(default=(401, {}))
    path = tmp_path / "nope"
    problems = check_sandbox(_e2b(sandbox_api_key_file=str(path)), {"E2B_API_URL": api.url, "E2B_API_KEY": "x"})
    assert problems == [f"rollout.sandbox.api_key_file {path}: no such file (it should hold the E2B_API_KEY value)"]


@pytest.mark.parametrize("content", ["", "\n", "   \n\t"])
def test_empty_key_file_fails_even_with_the_variable_set(tmp_path, content, stand_in):
    api = stand_in(default=(401, {}))
    path = tmp_path / "key"
    path.write_text(content)
    problems = check_sandbox(_e2b(sandbox_api_key_file=str(path)), {"E2B_API_URL": api.url, "E2B_API_KEY": "x"})
    assert problems == [f"rollout.sandbox.api_key_file {path} is empty: put the E2B_API_KEY value in it"]


def test_unreadable_key_file(tmp_path, stand_in):
    api = stand_in(default=(401, {}))
    path = tmp_path / "key-dir"
    path.mkdir()  # a directory: unreadable as a file even for root
    [problem] = check_sandbox(_e2b(sandbox_api_key_file=str(path)), {"E2B_API_URL": api.url})
    assert problem.startswith(f"rollout.sandbox.api_key_file {path}: cannot be read (")


def test_key_from_file_or_variable_passes(tmp_path, stand_in):
    api = stand_in(default=(401, {}))
    path = tmp_path / "key"
    path.write_text("e2b_0123\n")
    assert check_sandbox(_e2b(sandbox_api_key_file=str(path)), {"E2B_API_URL": api.url}) == []
    assert check_sandbox(_e2b(), {"E2B_API_URL": api.url, "E2B_API_KEY": "e2b_0123"}) == []


# ---- sandbox API reachability ---------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [200, 401, 403, 404, 429])
def test_api_answering_below_500_is_reachable(status, stand_in):
    api = stand_in(default=(status, {"message": "x"}))
    assert check_sandbox_api("e2b", {"E2B_API_URL": api.url}) == []
    [(method, path, headers)] = api.requests
    assert (method, path) == ("GET", "/sandboxes") and "x-api-key" not in headers  # the key is never sent


def test_api_answering_500(stand_in):
    api = stand_in(default=(500, {"message": "boom"}))
    assert check_sandbox_api("e2b", {"E2B_API_URL": api.url}) == [
        f"the e2b API at {api.url} (from E2B_API_URL) answered HTTP 500 to GET /sandboxes: the service is failing; "
        "retry later or check the URL setting"
    ]


def test_api_refusing_connections():
    url = refused_url()
    [problem] = check_sandbox_api("e2b", {"E2B_API_URL": url})
    assert problem.startswith(f"the e2b API at {url} (from E2B_API_URL) is unreachable (ConnectError")
    assert problem.endswith("check this machine's route to it, or the URL setting")


def test_api_timing_out(stand_in):
    api = stand_in(default=(200, {}), delay_s=2.0)
    t0 = time.perf_counter()
    assert check_sandbox_api("e2b", {"E2B_API_URL": api.url}, timeout_s=0.3) == [
        f"the e2b API at {api.url} (from E2B_API_URL) did not answer within 0.3s: check this machine's route to "
        "it, or the URL setting"
    ]
    assert time.perf_counter() - t0 < 1.5


def test_api_base_from_domain_names_its_setting():
    # Not contacted: a domain under .invalid never resolves, which is the unreachable case again.
    [problem] = check_sandbox_api("e2b", {"E2B_DOMAIN": "sandbox.invalid"}, timeout_s=2)
    assert problem.startswith("the e2b API at https://api.sandbox.invalid (from E2B_DOMAIN) is unreachable")


def test_providers_without_a_known_api_are_not_probed():
    assert check_sandbox_api("runloop", {}) == [] and check_sandbox_api("local", {}) == []


# ---- engine ---------------------------------------------------------------------------------------------------


def _engine(stand_in, model_path="/models/qwen", health=200, **kw):
    return stand_in(
        routes={"/health": (health, {}), "/model_info": (200, {"model_path": model_path, "weight_version": "0"})}, **kw
    )


def test_engine_serving_the_expected_model(stand_in, tmp_path):
    eng = _engine(stand_in, model_path=str(tmp_path / "m"))
    assert check_engine(eng.url, str(tmp_path / "m"), "model.source") == []
    # the same directory spelled through a symlink is the same model
    (tmp_path / "link").symlink_to(tmp_path / "m")
    assert check_engine(eng.url + "/", str(tmp_path / "link"), "model.source") == []


def test_engine_serving_another_model(stand_in):
    eng = _engine(stand_in, model_path="/models/other")
    assert check_engine(eng.url, "/models/qwen", "model.source") == [
        f"engine at {eng.url} serves `/models/other` (GET /model_info model_path), but model.source is "
        "`/models/qwen`: start SGLang with --model-path /models/qwen, or set model.source to the served model's "
        "directory"
    ]


def test_engine_not_healthy(stand_in):
    eng = _engine(stand_in, health=503)
    assert check_engine(eng.url, "/models/qwen", "model.source") == [
        f"engine at {eng.url}: GET /health answered HTTP 503: the server is not ready; wait for it to finish "
        "loading, restart it, or fix engine.url"
    ]


def test_engine_refusing_connections():
    url = refused_url()
    [problem] = check_engine(url, "/models/qwen", "model.source")
    assert problem.startswith(f"engine at {url}: no SGLang server answers GET /health (ConnectError")
    assert problem.endswith("start it (README, Production) or fix engine.url")


def test_engine_timing_out(stand_in):
    eng = _engine(stand_in, delay_s=2.0)
    [problem] = check_engine(eng.url, "/models/qwen", "model.source", timeout_s=0.3)
    assert problem.startswith(f"engine at {eng.url}: no SGLang server answers GET /health (ReadTimeout")


def test_engine_without_model_info(stand_in):
    eng = stand_in(routes={"/health": (200, {}), "/model_info": (404, {"detail": "Not Found"})})
    [problem] = check_engine(eng.url, "/models/qwen", "model.source")
    assert problem.startswith(
        f"engine at {eng.url}: neither GET /model_info (SGLang) nor GET /v1/models (vLLM) gave the model path "
        "(HTTPStatusError"
    )
    assert problem.endswith("is engine.url an SGLang or vLLM server?")
    eng2 = stand_in(routes={"/health": (200, {}), "/model_info": (200, {"model": "x"})})
    [problem] = check_engine(eng2.url, "/models/qwen", "model.source")
    assert "gave the model path (KeyError" in problem


def test_a_vllm_engine_names_its_model_in_v1_models(stand_in):
    """vLLM has no /model_info: its /v1/models' `root` is the --model it was started with."""
    models = {"object": "list", "data": [{"id": "/models/qwen", "root": "/models/qwen", "max_model_len": 2048}]}
    routes = {"/health": (200, {}), "/model_info": (404, {"detail": "Not Found"}), "/v1/models": (200, models)}
    eng = stand_in(routes=routes)
    assert check_engine(eng.url, "/models/qwen", "model.source") == []
    [problem] = check_engine(eng.url, "/models/other", "model.source")
    assert problem.startswith(f"engine at {eng.url} serves `/models/qwen`")


# ---- check_run: what each stage asks for ----------------------------------------------------------------------


def test_prepare_checks_neither_sandbox_nor_engine(tmp_path):
    cfg = parse_run_config(
        {
            "run_id": "p1",
            "output_dir": str(tmp_path),
            "rollout": {"sandbox": {"backend": "e2b"}},
            "engine": {"backend": "sglang", "url": refused_url()},
        }
    )
    assert check_run(cfg, "prepare", environ={}) == []


def test_train_collects_every_problem(tmp_path):
    (tmp_path / "t1").mkdir()
    url = refused_url()
    cfg = parse_run_config(
        {
            "run_id": "t1",
            "output_dir": str(tmp_path),
            "rollout": {"sandbox": {"backend": "e2b"}},
            "engine": {"backend": "sglang", "url": url},
        }
    )
    problems = check_run(cfg, "train", environ={"E2B_API_URL": url}, timeout_s=1)
    assert [p.split(" ")[0:2] for p in problems] == [
        ["run", "dir"],
        ["rollout.sandbox.backend=e2b", "needs"],
        ["the", "e2b"],
        ["engine", "at"],
    ]
    assert "already exists" in problems[0]


def test_embedded_engine_is_not_checked_before_it_starts(tmp_path, stand_in):
    api = stand_in(default=(401, {}))
    cfg = parse_run_config({"run_id": "e1", "output_dir": str(tmp_path), "rollout": {"sandbox": {"backend": "e2b"}}})
    assert check_run(cfg, "evaluate", environ={"E2B_API_URL": api.url, "E2B_API_KEY": "k"}) == []


def test_preflight_task_raises_listing_every_problem(tmp_path, monkeypatch):
    from tasks.preflight import preflight_task

    monkeypatch.delenv("E2B_API_KEY", raising=False)
    monkeypatch.setenv("E2B_API_URL", refused_url())
    (tmp_path / "t2").mkdir()
    cfg = parse_run_config({"run_id": "t2", "output_dir": str(tmp_path), "rollout": {"sandbox": {"backend": "e2b"}}})
    with pytest.raises(PreflightError) as info:
        preflight_task.fn(cfg, "train")
    lines = str(info.value).splitlines()
    assert lines[0] == "preflight found 3 problems:" and all(line.startswith("  - ") for line in lines[1:])
    assert len(lines) == 4 and "E2B_API_KEY" in lines[2]


def test_engine_preflight_task_names_the_prepared_model(stand_in):
    from tasks.preflight import engine_preflight_task

    eng = _engine(stand_in, model_path="/tmp/other")
    with pytest.raises(PreflightError, match="the prepared model is `/tmp/mine`: the engine was started on other"):
        engine_preflight_task.fn(eng.url, "/tmp/mine")


def test_format_problems_singular():
    assert format_problems(["a"]) == "preflight found 1 problem:\n  - a"


def test_terminus_without_tmux_on_the_host_is_a_problem_before_any_trial(tmp_path, monkeypatch):
    import grpoflow.rollout.harnesses

    cfg = parse_run_config(
        {
            "output_dir": str(tmp_path),
            "run_id": "h1",
            "rollout": {"harness": {"name": "terminus-2"}, "sandbox": {"backend": "local"}},
        }
    )
    real_which = grpoflow.rollout.harnesses.shutil.which
    monkeypatch.setattr(grpoflow.rollout.harnesses.shutil, "which", lambda n: None if n == "tmux" else real_which(n))
    problems = check_run(cfg, "train")
    assert any("terminus-2 needs tmux" in p for p in problems)


def test_missing_policy_key_file_is_a_problem(tmp_path):
    cfg = parse_run_config(
        {
            "output_dir": str(tmp_path),
            "run_id": "h2",
            "rollout": {"harness": {"name": "terminus-2", "policy_api_key_file": str(tmp_path / "nope.key")}},
        }
    )
    problems = check_run(cfg, "train")
    assert any("rollout.harness.policy_api_key_file" in p for p in problems)


@pytest.mark.parametrize("sampling", [{"top_p": 0.9}, {"top_k": 20}])
def test_a_train_run_refuses_a_filtered_sampling_an_evaluation_may_use(sampling):
    """Top-p / top-k would make the trials come from a narrower distribution than the one the trainer and the
    engine score: the run would optimise another objective than it samples."""
    cfg = parse_run_config({"rollout": sampling})
    (problem,) = preflight.sampling_problems(cfg.rollout)
    assert problem.startswith(f"rollout.{next(iter(sampling))}=") and "the trainer scores" in problem
    assert preflight.sampling_problems(parse_run_config({}).rollout) == []


def test_harbor_s_docker_environment_needs_compose_v2(tmp_path):
    # a docker CLI without the compose plugin (Debian's docker.io), and one with it
    bare, full = tmp_path / "docker-bare", tmp_path / "docker-full"
    bare.write_text("#!/bin/sh\necho \"docker: '$1' is not a docker command.\" >&2\nexit 1\n")
    full.write_text('#!/bin/sh\n[ "$1 $2" = "compose version" ] && echo "Docker Compose version v2.29.7"\n')
    for script in (bare, full):
        script.chmod(0o755)
    [problem] = preflight.check_docker_compose(str(bare))
    assert problem.startswith("rollout.sandbox.backend=docker: Harbor's docker environment needs `docker compose` (v2")
    assert "\n" not in problem and problem.endswith("or use rollout.sandbox.backend=local")
    assert preflight.check_docker_compose(str(full)) == []
    assert preflight.check_docker_compose(str(tmp_path / "no-such-docker")) != []


def test_a_distributed_sync_on_gpus_needs_one_nccl_on_both_sides(tmp_path):
    import subprocess
    import sys

    ours = subprocess.run([sys.executable, "-c", preflight._NCCL_PROBE], capture_output=True, text=True).stdout
    torch_ours, nccl_ours = ours.split()

    def engine_python(name, prints):  # the engine environment's python, as far as the probe asks it
        script = tmp_path / name
        script.write_text(f"#!/bin/sh\necho '{prints}'\n")
        script.chmod(0o755)
        return str(script)

    def cfg(python, sync="distributed", device="cuda"):
        engine = {
            "backend": "sglang-launch",
            "sglang": {"python": python},
            "launch": {"device": device},
            "weight_sync": {"mode": sync},
        }
        return parse_run_config({"run_id": "n", "engine": engine})

    other = engine_python("other", "2.9.1+cu128 2.27.3")
    [problem] = preflight.nccl_problems(cfg(other))
    assert problem == (
        f"engine.weight_sync.mode=distributed: the engine's torch 2.9.1+cu128 has NCCL 2.27.3, the trainer's torch "
        f"{torch_ours} NCCL {nccl_ours}: one communicator needs one NCCL (or set engine.weight_sync.mode=disk)"
    )
    assert preflight.nccl_problems(cfg(engine_python("same", f"2.9.1+cu128 {nccl_ours}"))) == []
    # a disk sync, or gloo on the CPU, joins no NCCL communicator
    assert preflight.nccl_problems(cfg(other, sync="disk")) == []
    assert preflight.nccl_problems(cfg(other, device="cpu")) == []
    [broken] = preflight.nccl_problems(cfg(str(tmp_path / "missing-python")))
    assert broken.startswith(f"engine.sglang.python {tmp_path / 'missing-python'}: cannot report its torch")
