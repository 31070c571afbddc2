"""A LocalSandbox's network as Harbor's policy asks: `public` reaches a package registry and none of this host's
services, `allowlist` only its hosts, and a policy switched between phases takes effect at once. Traffic goes only
to PyPI (a registry) and to listeners of this test; what a sandbox must not reach is refused inside its own
network namespace, before any packet leaves it."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harbor.models.task.config import NetworkMode, NetworkPolicy
from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig
from harbor.trial.trial import Trial

from grpoflow.embedded.sandbox.local import LocalSandbox
from grpoflow.embedded.sandbox.network import host_addresses, missing_network_tools
from grpoflow.rollout.environments import LOCAL_SANDBOX_IMPORT_PATH

REGISTRY = "pypi.org"
PUBLIC = NetworkPolicy(network_mode=NetworkMode.PUBLIC)
NONE = NetworkPolicy(network_mode=NetworkMode.NO_NETWORK)
# Runs in the sandbox with the host's python3: each probe prints "ok" or the error's class.
PROBE = """
import json, socket, sys, urllib.request
def tcp(host, port):
    try:
        socket.create_connection((host, port), timeout=5).close()
        return "ok"
    except OSError as exc:
        return type(exc).__name__
def https(host):
    try:
        urllib.request.urlopen(f"https://{host}/simple/pip/", timeout=20).read(64)
        return "ok"
    except OSError as exc:
        return type(exc).__name__
out = {"registry": https(sys.argv[1])}
for spec in sys.argv[2:]:
    host, port = spec.rsplit(":", 1)
    out[spec] = tcp(host, int(port))
print(json.dumps(out))
"""


@pytest.fixture(autouse=True)
def _needs_root_and_tools() -> None:
    if os.geteuid() != 0:
        pytest.skip("a local sandbox gets a network only as root")
    if problems := missing_network_tools():
        pytest.fail("; ".join(problems) + " (./run.sh installs them)")


@pytest.fixture(params=["exec", "trial"])
def scope(request: pytest.FixtureRequest) -> str:
    """Both process scopes: every exec's bwrap joins the trial's network namespace, or the holder's does."""
    return request.param


@pytest.fixture
def listeners() -> Iterator[dict[str, socket.socket]]:
    """A listener on this host's loopback and one on all its addresses: {"loopback": sock, "any": sock}."""
    socks = {}
    for name, address in (("loopback", "127.0.0.1"), ("any", "0.0.0.0")):
        sock = socks[name] = socket.socket()
        sock.bind((address, 0))
        sock.listen(8)
        sock.setblocking(False)
    yield socks
    for sock in socks.values():
        sock.close()


async def probe(env: LocalSandbox, *targets: str) -> dict[str, str]:
    (env_dir := env.trial_paths.trial_dir / "probe").mkdir(exist_ok=True)
    (env_dir / "probe.py").write_text(PROBE)
    await env.upload_file(env_dir / "probe.py", "/tmp/probe.py")
    result = await env.exec(f"python3 /tmp/probe.py {REGISTRY} {' '.join(targets)}", timeout_sec=60)
    assert result.return_code == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def forbidden(listeners: dict[str, socket.socket]) -> list[str]:
    """Where a sandbox must never connect: this host's services by every way to them (slirp's gateway leads to
    the host's loopback unless cut off; the host's own addresses), and the cloud metadata address."""
    ports = {name: sock.getsockname()[1] for name, sock in listeners.items()}
    own = [f"{a}:{ports['any']}" for a in host_addresses() if not a.startswith("127.")]
    assert own, "this host has an address beside loopback"
    return [f"10.0.2.2:{ports['loopback']}", f"127.0.0.1:{ports['loopback']}", "169.254.169.254:80", *own]


def test_public_reaches_a_registry_and_no_host_service(
    make_sandbox: Callable[..., LocalSandbox], listeners: dict[str, socket.socket], scope: str
) -> None:
    targets = forbidden(listeners)

    async def main() -> dict[str, str]:
        env = make_sandbox(network_policy=PUBLIC, process_scope=scope)
        await env.start(force_build=False)
        return await probe(env, *targets)

    seen = asyncio.run(main())
    assert seen["registry"] == "ok", seen
    assert all(seen[t] != "ok" for t in targets), seen
    for sock in listeners.values():
        with pytest.raises(BlockingIOError):
            sock.accept()  # nothing ever connected


def test_allowlist_reaches_only_its_hosts(make_sandbox: Callable[..., LocalSandbox]) -> None:
    # An address no allowed host resolves to (refused inside: nothing is sent to it), and another registry's name,
    # which the sandbox cannot resolve.
    other = "198.51.100.7"
    policy = NetworkPolicy(network_mode=NetworkMode.ALLOWLIST, allowed_hosts=[REGISTRY])

    async def main() -> tuple[dict[str, str], str]:
        env = make_sandbox(network_policy=policy)
        await env.start(force_build=False)
        seen = await probe(env, f"{other}:443")
        dns = await env.exec("getent hosts deb.debian.org pypi.org", timeout_sec=30)
        return seen, dns.stdout

    seen, names = asyncio.run(main())
    assert seen == {"registry": "ok", f"{other}:443": seen[f"{other}:443"]} and seen[f"{other}:443"] != "ok", seen
    assert "pypi.org" in names and "deb.debian.org" not in names  # its own names only, from /etc/hosts


def test_a_phase_switches_the_network_at_once(make_sandbox: Callable[..., LocalSandbox], scope: str) -> None:
    async def main() -> list[str]:
        # As Harbor makes it for an agent without network and a verifier with it.
        env = make_sandbox(network_policy=NONE, phase_network_policies=[NONE, PUBLIC], process_scope=scope)
        await env.start(force_build=False)
        seen = [(await probe(env))["registry"]]
        await env.set_network_policy(PUBLIC)
        seen.append((await probe(env))["registry"])
        await env.set_network_policy(NONE)
        seen.append((await probe(env))["registry"])
        return seen

    before, during, after = asyncio.run(main())
    assert (before, during, after) == (before, "ok", after) and before != "ok" and after != "ok"


# The oracle (agent phase, no network) records whether it reached the registry; the verifier (public) reaches it
# and passes only if the oracle did not.
PHASED_TASK = {
    "task.toml": """version = "1.0"
[environment]
network_mode = "no-network"
[agent]
timeout_sec = 60
[verifier]
timeout_sec = 60
network_mode = "public"
""",
    "instruction.md": "Write /app/done.\n",
    "environment/Dockerfile": "FROM debian:bookworm-slim\nWORKDIR /app\n",
    "solution/solve.sh": "#!/bin/bash\n" + f"python3 /solution/probe.py {REGISTRY} > /app/agent-phase.json\n",
    "solution/probe.py": PROBE,
    "tests/probe.py": PROBE,
    "tests/test.sh": "#!/bin/bash\n"
    + f"python3 /tests/probe.py {REGISTRY} > /logs/verifier/verifier-phase.json\n"
    + 'grep -q \'"registry": "ok"\' /logs/verifier/verifier-phase.json '
    + "&& grep -q registry /app/agent-phase.json "
    + '&& ! grep -q \'"registry": "ok"\' /app/agent-phase.json && echo 1 > /logs/verifier/reward.txt '
    + "|| echo 0 > /logs/verifier/reward.txt\n",
}


def test_harbor_gives_the_agent_and_the_verifier_their_own_policies(bwrap: str, tmp_path: Path) -> None:
    task = tmp_path / "phased"
    for rel, text in PHASED_TASK.items():
        (task / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / rel).write_text(text)
        if rel.endswith(".sh"):
            (task / rel).chmod(0o755)
    config = TrialConfig(
        task=TaskConfig(path=task),
        agent=AgentConfig(name="oracle"),
        trials_dir=tmp_path / "trials",
        environment=EnvironmentConfig(import_path=LOCAL_SANDBOX_IMPORT_PATH, kwargs={"base_images": {}}),
    )

    async def main():
        return await (await Trial.create(config)).run()

    result = asyncio.run(main())
    assert result.exception_info is None, result.exception_info
    assert result.verifier_result is not None and result.verifier_result.rewards == {"reward": 1.0}


def test_harbor_takes_the_allowlist_forms_the_sandbox_enforces(make_sandbox: Callable[..., LocalSandbox]) -> None:
    env = make_sandbox(network_policy=NONE)
    for hosts in (["127.0.0.1"], ["pypi.org", "1.2.3.4", "5.6.0.0/16"]):  # the first: a CLI harness's bridge
        env.validate_network_policy_support(NetworkPolicy(network_mode=NetworkMode.ALLOWLIST, allowed_hosts=hosts))
    for hosts in (["*.pypi.org"], ["2001:db8::1"]):
        with pytest.raises(ValueError, match="not supported by grpoflow-local"):
            env.validate_network_policy_support(NetworkPolicy(network_mode=NetworkMode.ALLOWLIST, allowed_hosts=hosts))
