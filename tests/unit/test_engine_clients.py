"""One client class per engine API, chosen in one place, and one config type per backend: nothing in the core
branches on which API an engine speaks or on a backend's name, and every class answers every method the pipeline
calls."""

import ast
from pathlib import Path

import pytest

import grpoflow
from grpoflow.engine.client import EngineClient, SglangClient
from grpoflow.engine.clients import CLIENTS, engine_client
from grpoflow.engine.vllm_client import VllmClient
from grpoflow.errors import EngineError

CORE = Path(grpoflow.__file__).parent
CHOOSER = CORE / "engine" / "clients.py"
API_NAMES = {"api", "engine_api"}
BACKEND_NAMES = {"embedded", "sglang", "vllm", "sglang-launch", "vllm-launch"}


def _strings(node: ast.AST) -> set[str]:
    """The string constants `node` is, or holds (a tuple, list or set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return {s for e in node.elts for s in _strings(e)}
    return set()


def _api_branches(path: Path) -> list[str]:
    """`x.api == ...`-like comparisons, comparisons with a backend's name (`cfg.backend in ("vllm", ...)`) and
    `api=` keywords (a client told its API) in `path`, as `file:line`; passing the name on as data
    (`engine.api` handed to the chooser) is no branch."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names = {s.attr if isinstance(s, ast.Attribute) else getattr(s, "id", None) for s in sides}
            if names & API_NAMES or set().union(*map(_strings, sides)) & BACKEND_NAMES:
                found.append(f"{path.relative_to(CORE.parent)}:{node.lineno}")
        elif isinstance(node, ast.Call) and any(k.arg == "api" for k in node.keywords):
            found.append(f"{path.relative_to(CORE.parent)}:{node.lineno}")
    return found


def test_no_module_but_the_chooser_branches_on_the_engine_api():
    modules = [p for p in CORE.rglob("*.py") if p != CHOOSER]
    assert [hit for p in modules for hit in _api_branches(p)] == []


def test_the_scan_finds_a_branch_where_there_is_one(monkeypatch, tmp_path):
    planted = tmp_path / "grpoflow" / "planted.py"
    planted.parent.mkdir()
    planted.write_text(
        'def f(cfg, c):\n    if cfg.api == "vllm":\n        return c(api=cfg.api)\n'
        '    if cfg.backend in ("sglang-launch", "vllm-launch"):\n        return 1\n'
    )
    monkeypatch.setattr(f"{__name__}.CORE", tmp_path / "grpoflow")
    assert sorted(_api_branches(planted)) == ["grpoflow/planted.py:2", "grpoflow/planted.py:3", "grpoflow/planted.py:4"]


@pytest.mark.parametrize(("api", "cls"), [("sglang", SglangClient), ("vllm", VllmClient)])
def test_each_api_name_gives_its_class_whole(api, cls):
    client = engine_client(api, "http://127.0.0.1:9/", timeout=1.0, retries=0)
    assert type(client) is cls and isinstance(client, EngineClient) and client.base_url == "http://127.0.0.1:9"
    assert client.name in ("SGLang", "vLLM") and not getattr(cls, "__abstractmethods__", None)


def test_every_api_a_config_can_name_has_a_class():
    from grpoflow.config import ENGINE_TYPES

    assert set(ENGINE_TYPES) == BACKEND_NAMES  # the scan above looks for every name a config can give
    assert {kind.api for kind in ENGINE_TYPES.values()} == set(CLIENTS)


def test_a_vllm_server_is_its_own_only_replica_and_reports_no_busy_time():
    client = VllmClient("http://127.0.0.1:9", retries=0)
    assert client.replicas() == ["http://127.0.0.1:9"] and client.busy_seconds() is None


@pytest.mark.parametrize("api", sorted(CLIENTS))
def test_an_attached_engine_alone_is_no_router_however_its_url_is_spelled(api, monkeypatch):
    """A lone attached engine is its own replica: the run must never take it for a router and remove workers."""
    from grpoflow.config import parse_run_config
    from grpoflow.engine.backends import open_engine

    monkeypatch.setattr(CLIENTS[api], "health", lambda self, timeout=5.0: True)
    cfg = parse_run_config({"engine": {"backend": api, "url": "http://127.0.0.1:9/"}}).engine
    with open_engine(cfg, "m", 0, Path("/nonexistent/engine.log")) as handle:
        assert handle.router is None and handle.replica_urls == ["http://127.0.0.1:9"]


@pytest.mark.parametrize(
    "server_args, ranks",
    [({"tp_size": 4}, 4), ({}, 1), ({"tp_size": 2, "pp_size": 2}, None), ({"dp_size": 2}, None)],
)
def test_sglangs_weight_update_ranks_are_its_tensor_parallel_workers(server_args, ranks):
    """SGLang's workers join a weight-update group as rank_offset + their tensor-parallel rank: a server with
    pipeline or data parallelism would give two of them one rank, so the in-memory sync refuses it, naming both
    sizes and the way out."""
    from tests.fakes.sglang_standin import StandinServer

    with StandinServer(server_args=server_args) as server, SglangClient(server.url) as client:
        if ranks is not None:
            assert client.weight_update_ranks() == ranks
        else:
            with pytest.raises(EngineError, match=r"pp_size \d and dp_size \d: .*engine.weight_sync.mode=disk"):
                client.weight_update_ranks()
