"""The engine a run talks to, whichever backend: the embedded one started for the run (or several, behind an
sglang-router started with them: `engine.embedded.replicas`), an SGLang or vLLM server started for the run from its own
environment, or an SGLang server (or a router in front of several) or a vLLM server already running. Either way
the rest of the pipeline generates through one URL with one client (`EngineClient`: the class of `engine.api`,
answering as SGLang does) that retries infrastructure faults (`engine.retries`)
before the step fails with `EngineError`; weight syncs go to each replica's own URL."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpoflow.config import AttachedEngine, EmbeddedEngine, Engine, LaunchedEngine, SglangLaunch, VllmLaunch
from grpoflow.engine import sglang_launch, vllm_launch
from grpoflow.engine.client import EngineClient
from grpoflow.engine.clients import client_of
from grpoflow.engine.launch import EngineProcess, start_embedded_engine
from grpoflow.engine.router import start_router
from grpoflow.errors import EngineError


@dataclass(frozen=True)
class EngineHandle:
    url: str  # where generation goes: the engine, or the router in front of its replicas
    client: EngineClient
    replicas: tuple[str, ...] = ()  # each engine's own URL (weight syncs, probes); empty: just `url`
    host_threads: int = 0  # CPU threads the run's engines use on this host, beside a CPU trainer
    processes: tuple[EngineProcess, ...] = ()  # the engines the run started, as `replica_urls`; none attached

    @property
    def replica_urls(self) -> list[str]:
        return list(self.replicas) or [self.url]

    @property
    def router(self) -> str | None:
        """The router's URL when generation goes through one, else None."""
        return self.url if self.replica_urls != [self.url] else None


@contextmanager
def open_engine(
    cfg: Engine,
    model_path: str,
    seed: int,
    log_path: Path,
    base_gpu_id: int | None = None,
    host: str = "127.0.0.1",
) -> Iterator[EngineHandle]:
    """Start (or reach) the engine for the block; a started one is stopped when the block ends, however it ends.
    `base_gpu_id`: where a launched engine's GPUs start (the run's `placement.GpuPlan`); `host`: the address a
    started engine and its router listen on (`cluster.serve_host`)."""
    if isinstance(cfg, EmbeddedEngine):
        with ExitStack() as stack:
            engines = [
                stack.enter_context(
                    start_embedded_engine(
                        model_path,
                        seed=seed,
                        threads=cfg.embedded.threads,
                        startup_timeout=cfg.startup_timeout_s,
                        log_path=_replica_log(log_path, i, cfg.embedded.replicas),
                        client_timeout=cfg.request_timeout_s,
                        client_retries=cfg.retries,
                        # Deterministic: a request's forwards never depend on what else is running or was cached.
                        max_batch_size=1 if cfg.deterministic else cfg.embedded.max_batch_size,
                        prefix_cache_tokens=0 if cfg.deterministic else None,
                        host=host,
                    )
                )
                for i in range(cfg.embedded.replicas)
            ]
            threads = cfg.embedded.threads * cfg.embedded.replicas
            if len(engines) == 1:
                yield EngineHandle(engines[0].url, engines[0].client, host_threads=threads, processes=(engines[0],))
                return
            urls = [e.url for e in engines]
            router = stack.enter_context(
                start_router(
                    urls,
                    policy=cfg.embedded.router_policy,
                    log_path=log_path.with_name("router.log"),
                    client_timeout=cfg.request_timeout_s,
                    client_retries=cfg.retries,
                    host=host,
                    request_timeout=cfg.longest_generation_s(),
                )
            )
            yield EngineHandle(router.url, router.client, tuple(urls), host_threads=threads, processes=tuple(engines))
        return
    if isinstance(cfg, LaunchedEngine):
        with LAUNCHERS[type(cfg)](cfg, model_path, seed, log_path, base_gpu_id, host) as server:
            yield EngineHandle(server.url, server.client, processes=(server,))
        return
    assert isinstance(cfg, AttachedEngine), f"no way to open {type(cfg).__name__}"
    url = cfg.url
    client = client_of(cfg, url)
    if not client.health():
        client.close()
        raise EngineError(f"engine.url {url}: no healthy {client.name} server answers there (GET /health)")
    try:
        # a router's servers, or the one; both spelled as the client does (no trailing slash) so that one is no router
        yield EngineHandle(client.base_url, client, tuple(client.replicas()))
    finally:
        client.close()


def _common(cfg: LaunchedEngine, log_path: Path, host: str) -> dict[str, Any]:
    return {
        "log_path": log_path,
        "startup_timeout": cfg.startup_timeout_s,
        "client_timeout": cfg.request_timeout_s,
        "client_retries": cfg.retries,
        "host": host,
    }


def _launch_sglang(
    cfg: SglangLaunch, model_path: str, seed: int, log_path: Path, base_gpu_id: int | None, host: str
) -> EngineProcess:
    """The SGLang server `cfg` launches, serving, on the GPUs from `base_gpu_id` on (the run's plan)."""
    extra_args, env = sglang_launch.launch_settings(cfg, seed, base_gpu_id)
    return sglang_launch.start_sglang_server(
        cfg.python,
        model_path,
        tp_size=cfg.tp_size,
        mem_fraction_static=cfg.launch.mem_fraction_static,
        extra_args=extra_args,
        env=env,
        **_common(cfg, log_path, host),
    )


def _launch_vllm(
    cfg: VllmLaunch, model_path: str, seed: int, log_path: Path, base_gpu_id: int | None, host: str
) -> EngineProcess:
    """The vLLM server `cfg` launches, serving, on the GPUs from `base_gpu_id` on (the run's plan)."""
    extra_args, env = vllm_launch.launch_settings(cfg, seed, base_gpu_id)
    return vllm_launch.start_vllm_server(
        cfg.python, model_path, extra_args=extra_args, env=env, **_common(cfg, log_path, host)
    )


# Each launched backend's launcher, by its config type.
LAUNCHERS: dict[type[LaunchedEngine], Callable[..., EngineProcess]] = {
    SglangLaunch: _launch_sglang,
    VllmLaunch: _launch_vllm,
}


def _replica_log(log_path: Path, i: int, n: int) -> Path:
    """`engine.log` for one engine; `engine-<i>.log` per replica."""
    return log_path if n == 1 else log_path.with_name(f"{log_path.stem}-{i}{log_path.suffix}")
