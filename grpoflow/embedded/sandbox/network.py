"""A local sandbox's network, as Harbor's network policy asks for it: `no-network`, `public` or `allowlist`.

A trial whose policies (its own and its phases') are all `no-network` keeps bwrap's empty network namespace, as
before. Any other trial gets a network namespace made here (owned by the host's user namespace, so nothing in the
sandbox, whose user namespace is a child of it, holds a capability over it: its routes and rules are out of
reach) that every bwrap of the trial joins through the launcher (`--netns`). Into it:
- `slirp4netns`, a user-mode network stack on the host side (as rootless containers use): the sandbox's traffic
  leaves as this host's own connections. It runs with its own sandbox and seccomp filter, and with the host's
  loopback cut off (`--disable-host-loopback`: its gateway does not lead to 127.0.0.1).
- an nftables table of ours on the namespace's output, swapped whole (one transaction) for each policy:
  `no-network` lets out nothing but loopback; `public` everything but the denied ranges; `allowlist` only its
  addresses. Denied in every mode: private, shared, loopback and link-local ranges (no host service, no cloud
  metadata address), multicast and reserved (`DENIED_V4`), this host's own addresses, and all of IPv6 but
  loopback; slirp's DNS forwarder is reached only under `public`.
- /etc/resolv.conf and /etc/hosts, files of the trial dir bound read-only over the base's and rewritten in place
  for each policy: `public` resolves through slirp's forwarder; `allowlist` resolves nothing but its own host
  names, each mapped to the IPv4 addresses the host resolved when the policy was applied.

`allowed_hosts` honoured: exact host names, IPv4 addresses and IPv4 CIDR ranges. Wildcard names (which only a
proxy that reads each request's host name can enforce) and IPv6 entries (slirp's stack carries IPv4 here) are
refused before the trial starts (the sandbox's `capabilities`).

Root only: joining a namespace owned by the host's user namespace needs the host's CAP_SYS_ADMIN.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path

from harbor.models.task.config import (
    NetworkAllowlistEntryType,
    NetworkMode,
    NetworkPolicy,
    classify_network_allowlist_entry,
)

from grpoflow.embedded.sandbox.processes import HOST_ENV, missing_tools
from grpoflow.rollout.environments import BRIDGE_HOST, SandboxStartError, SandboxUnavailableError
from grpoflow.sandbox_settings import DENIED_V4

# Host tools a trial with a network needs, and their Debian packages.
NETWORK_TOOLS: dict[str, str] = {"slirp4netns": "slirp4netns", "nft": "nftables", "nsenter": "util-linux"}
SLIRP_DNS = "10.0.2.3"  # slirp4netns's DNS forwarder on its default 10.0.2.0/24
TABLE = "grpoflow_sandbox"
LOCALHOST = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"


# The sandbox's own loopback (where a session bridge listens): reached in every mode, no network needed for it.
LOOPBACK_HOSTS = frozenset({BRIDGE_HOST, "localhost"})


def needs_network(policies: list[NetworkPolicy]) -> bool:
    """Whether any of a trial's policies lets out more than its own loopback."""
    return any(
        p.network_mode == NetworkMode.PUBLIC
        or (p.network_mode == NetworkMode.ALLOWLIST and not set(p.allowed_hosts) <= LOOPBACK_HOSTS)
        for p in policies
    )


def missing_network_tools() -> list[str]:
    """`missing_tools` for a trial with a network, found where the host-side processes look (sbin included)."""
    return missing_tools(lambda tool: shutil.which(tool, path=HOST_ENV["PATH"]), NETWORK_TOOLS)


def host_addresses() -> list[str]:
    """This host's own IPv4 addresses (the kernel's LOCAL routes), so a sandbox cannot reach a host service
    through a public address of the host's."""
    found: set[str] = set()
    previous = ""
    with contextlib.suppress(OSError), open("/proc/net/fib_trie", encoding="ascii") as f:
        for line in f:
            text = line.strip()
            if text.startswith("/32 host LOCAL"):
                found.add(previous)
            elif text.startswith("|--"):
                previous = text[3:].strip()
    return sorted(a for a in found if a)


def resolve_allowlist(entries: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """(IPv4 networks let out, {host name: its IPv4 addresses}) for `allowed_hosts`. A name that does not resolve
    is a failed start: the trial would fail for want of a host the task named."""
    networks: list[str] = []
    names: dict[str, list[str]] = {}
    for entry in entries:
        if classify_network_allowlist_entry(entry) != NetworkAllowlistEntryType.HOSTNAME:  # an IPv4 address or range
            networks.append(str(ipaddress.IPv4Network(entry, strict=False)))
            continue
        try:
            infos = socket.getaddrinfo(entry, None, socket.AF_INET, socket.SOCK_STREAM)
        except OSError as exc:
            raise SandboxStartError(f"the allowlisted host {entry} does not resolve here: {exc}") from exc
        addresses = sorted({str(info[4][0]) for info in infos})
        names[entry] = addresses
        networks += [f"{a}/32" for a in addresses]
    return networks, names


def ruleset(mode: NetworkMode, allowed: list[str], host: list[str]) -> str:
    """The nft script that replaces our table with the rules of `mode` (one transaction: no moment unfiltered)."""
    # One set of disjoint ranges (the host's own addresses may fall in the denied ones).
    nets = ipaddress.collapse_addresses(ipaddress.IPv4Network(n) for n in [*DENIED_V4, *host])
    denied = ", ".join(str(n) for n in nets)
    rules = ['oifname "lo" accept', "meta nfproto ipv6 reject"]
    if mode == NetworkMode.PUBLIC:
        rules += [f"ip daddr {SLIRP_DNS} meta l4proto {{ tcp, udp }} th dport 53 accept"]
    rules += [f"ip daddr {{ {denied} }} reject"]
    if mode == NetworkMode.PUBLIC:
        rules += ["accept"]
    elif mode == NetworkMode.ALLOWLIST and allowed:
        rules += [f"ip daddr {{ {', '.join(allowed)} }} accept"]
    rules += ["reject"]
    body = "\n".join(f"    {rule}" for rule in rules)
    return (
        f"table inet {TABLE} {{}}\ndelete table inet {TABLE}\n"
        f"table inet {TABLE} {{\n  chain out {{\n    type filter hook output priority 0; policy drop;\n"
        f"{body}\n  }}\n}}\n"
    )


class TrialNetwork:
    """One trial's network namespace with slirp4netns attached; `apply` sets a policy, `close` ends it all.

    `etc`: the dir of the trial's resolv.conf and hosts (bound over /etc's by the caller)."""

    def __init__(self, etc: Path, session_id: str):
        if os.geteuid() != 0:
            raise SandboxUnavailableError(
                f"sandbox for {session_id}: a task with a network (network_mode public or allowlist) runs on the "
                "local sandbox only as root (its network namespace is the host's to filter); run as root or "
                'give the task network_mode = "no-network"'
            )
        problems = missing_network_tools()
        if problems:
            raise SandboxUnavailableError("; ".join(problems))
        self.session_id = session_id
        self.resolv, self.hosts, self.log = etc / "resolv.conf", etc / "hosts", etc / "slirp4netns.log"
        for path in (self.resolv, self.hosts):
            path.write_text("")
            path.chmod(0o644)
        self._fd = _new_netns()
        self._slirp: subprocess.Popen[bytes] | None = None
        self._exit_w: int | None = None
        try:
            self._start_slirp()
        except BaseException:
            self.close()
            raise

    @property
    def path(self) -> str:
        """The namespace as a path any of our root processes can open (our fd keeps it alive)."""
        return f"/proc/{os.getpid()}/fd/{self._fd}"

    def _start_slirp(self) -> None:
        exit_r, self._exit_w = os.pipe()  # slirp4netns ends when this closes: with close(), or with our process
        ready_r, ready_w = os.pipe()
        argv = ["slirp4netns", "--configure", "--mtu=65520", "--disable-host-loopback", "--enable-sandbox"]
        argv += ["--enable-seccomp", f"--exit-fd={exit_r}", f"--ready-fd={ready_w}", "--netns-type=path"]
        try:
            with open(self.log, "wb") as log:  # a file, not a pipe: nothing read could ever block it
                self._slirp = subprocess.Popen(
                    [*argv, self.path, "tap0"],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=(exit_r, ready_w),
                    env=HOST_ENV,
                    start_new_session=True,
                )
            os.close(ready_w)
            ready_w = -1
            ready = os.read(ready_r, 1)  # b"" (EOF): slirp4netns ended before configuring the namespace
        finally:
            for fd in (exit_r, ready_w, ready_r):
                if fd >= 0:
                    os.close(fd)
        if not ready:
            self._slirp.wait()
            err = self.log.read_text(errors="replace").strip()
            raise SandboxStartError(f"sandbox for {self.session_id}: slirp4netns did not start: {err[-500:]}")

    def apply(self, policy: NetworkPolicy) -> None:
        """Make `policy` the one in force: its rules in one swap, then the names the sandbox resolves."""
        mode = policy.network_mode
        allowed, names = resolve_allowlist(list(policy.allowed_hosts)) if mode == NetworkMode.ALLOWLIST else ([], {})
        script = ruleset(mode, allowed, host_addresses())
        done = subprocess.run(
            ["nsenter", f"--net={self.path}", "nft", "-f", "-"],
            input=script.encode(),
            capture_output=True,
            env=HOST_ENV,
            check=False,
        )
        if done.returncode != 0:
            raise SandboxStartError(
                f"sandbox for {self.session_id}: its network rules ({mode.value}) were not applied: "
                f"{done.stderr.decode(errors='replace').strip()[-500:]}"
            )
        # In place (same inode): the sandbox's bind mounts of these files see the new text.
        _rewrite(self.resolv, f"nameserver {SLIRP_DNS}\n" if mode == NetworkMode.PUBLIC else "")
        extra = "".join(f"{address}\t{name}\n" for name, addresses in names.items() for address in addresses)
        _rewrite(self.hosts, LOCALHOST + extra)

    def close(self) -> None:
        if self._exit_w is not None:
            os.close(self._exit_w)
            self._exit_w = None
        if self._slirp is not None:
            slirp, self._slirp = self._slirp, None
            try:
                slirp.wait(timeout=5)
            except subprocess.TimeoutExpired:
                slirp.kill()
                slirp.wait()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _rewrite(path: Path, text: str) -> None:
    with open(path, "r+", encoding="utf-8") as f:
        f.truncate(0)
        f.write(text)


def _new_netns() -> int:
    """An fd of a new network namespace. Made by a thread of its own, which alone moves into it and then ends."""
    made: list[int] = []
    failed: list[OSError] = []

    def make() -> None:
        try:
            os.unshare(os.CLONE_NEWNET)
            made.append(os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC))
        except OSError as exc:
            failed.append(exc)

    thread = threading.Thread(target=make, name="sandbox-netns")
    thread.start()
    thread.join()
    if failed:
        raise SandboxStartError(f"could not make a network namespace: {failed[0]}") from failed[0]
    return made[0]
