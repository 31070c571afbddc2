"""The Ray cluster a run works on (`cluster.ray_address`), held for the run: rollout workers
(`grpoflow.rollout.workers`) and trainer ranks beyond this machine (`grpoflow.train.ranks`) are its actors.
Ray is imported only when a run asks for it."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from grpoflow.config import ClusterConfig
from grpoflow.offline import OFFLINE_ENV


@contextmanager
def ray_session(cluster: ClusterConfig) -> Iterator[bool]:
    """Connected to the cluster for the block (True), or no Ray at all (False: `ray_address` empty). `local`
    starts Ray on this machine for the block; an address joins a running cluster. Ray already initialised in
    this process (a driver of its own) is used as it is and left running."""
    if not cluster.ray_address:
        yield False
        return
    import ray

    started = not ray.is_initialized()
    if started:
        address = None if cluster.ray_address == "local" else cluster.ray_address
        # ray.init makes SIGTERM exit at once (its own handler): the command's, which runs the cleanups and says
        # how to resume, is put back (Python takes signals in the main thread only, where Ray sets its own)
        main_thread = threading.current_thread() is threading.main_thread()
        on_term = signal.getsignal(signal.SIGTERM) if main_thread else None
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        except ConnectionError as err:
            raise ConnectionError(f"cluster.ray_address {cluster.ray_address}: no Ray cluster there ({err})") from None
        finally:
            if on_term is not None:
                signal.signal(signal.SIGTERM, on_term)
    try:
        yield True
    finally:
        if started:
            ray.shutdown()


LOOPBACK = "127.0.0.1"


def serve_host(cluster: ClusterConfig) -> str:
    """Where the servers this run starts listen (`cluster.listen_host`): loopback unless asked, or unless the
    run's Ray cluster (connected: call inside `ray_session`) has nodes on other machines, whose rollout workers
    must reach them at this node's address."""
    if cluster.listen_host:
        return cluster.listen_host
    if not cluster.ray_address or cluster.ray_address == "local":
        return LOOPBACK
    import ray.util

    return ray.util.get_node_ip_address()


def forwarded_env() -> dict[str, str]:
    """What a run's actors get of this process's environment: the offline settings (`grpoflow.offline`) and MKL's
    reproducible mode (`grpoflow.numerics`), as this process has them. No credentials: Ray keeps an actor's environment where its dashboard and state API
    show it, so a sandbox provider's key must be in the environment each node's `ray start` ran in."""
    import os

    return {k: os.environ[k] for k in (*OFFLINE_ENV, "MKL_CBWR") if k in os.environ}
