"""The local sandbox's settings as `rollout.sandbox.kwargs` gives them, checked when the run config is, so a bad
value is one line naming the key before anything is written (the sandbox's constructor would refuse it only once
the first trial starts). `LocalSandbox.__init__` validates its keywords with this model, the one home of their
defaults; grpoflow sets its other keywords (the session bridge, the CLI dir) itself. Also the forms of Harbor's
`allowed_hosts` that the local sandbox enforces, read by prepare (which refuses the others) and by the sandbox
(its capabilities)."""

from __future__ import annotations

import ipaddress
from typing import Any, Literal

from harbor.models.task.config import NetworkAllowlistEntryType, TaskConfig, classify_network_allowlist_entry
from pydantic import BaseModel, ConfigDict, Field, ValidationError

# The allowlist forms the local sandbox enforces (by address, in its network namespace; names are resolved when the
# policy is applied), each with the flag of Harbor's `EnvironmentCapabilities` that says so. A wildcard needs a
# proxy that reads each request's host name; IPv6 is not routed.
ALLOWLIST_FORMS: dict[NetworkAllowlistEntryType, str] = {
    NetworkAllowlistEntryType.HOSTNAME: "network_allowlist_hostnames",
    NetworkAllowlistEntryType.IPV4_ADDRESS: "network_allowlist_ipv4_addresses",
    NetworkAllowlistEntryType.IPV4_CIDR: "network_allowlist_ipv4_cidrs",
}
# Never reached from a local sandbox, whatever the policy: where a host's or a network's own services live (RFC
# 6890's "this network", private, shared, loopback, link-local and IETF ranges), multicast and reserved.
DENIED_V4: tuple[str, ...] = (
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.168.0.0/16",
    "224.0.0.0/3",
)


def allowlist_problem(config: TaskConfig) -> str | None:
    """The first `allowed_hosts` entry of task.toml (environment, agent or verifier) that the local sandbox does not
    enforce, as one line naming the field; None when every one is enforced."""
    unreachable = [ipaddress.IPv4Network(d) for d in DENIED_V4 if d != "127.0.0.0/8"]  # loopback: its own
    for section in ("environment", "agent", "verifier"):
        for entry in getattr(config, section).allowed_hosts or []:
            form = classify_network_allowlist_entry(entry)
            where = f"task.toml [{section}] allowed_hosts {entry!r}"
            if form not in ALLOWLIST_FORMS:
                return (
                    f"{where}: a {form.value} entry; the local sandbox enforces host names, IPv4 addresses and IPv4 "
                    "CIDR ranges"
                )
            if form != NetworkAllowlistEntryType.HOSTNAME:
                net = ipaddress.IPv4Network(entry, strict=False)
                if any(net.subnet_of(d) for d in unreachable):
                    return f"{where}: a private, link-local or reserved range, which no local sandbox reaches"
    return None


class LocalSandboxSettings(BaseModel):
    # strict: the constructor takes ints, not "512" or 512.0 or true
    model_config = ConfigDict(extra="forbid", strict=True)

    cpu_time_sec: int = Field(300, gt=0, le=2**31 - 1, description="RLIMIT_CPU of every process, in CPU seconds.")
    memory_mb: int | None = Field(
        None,
        gt=0,
        le=2**30,
        description="Memory a trial may use, in MiB, as Docker's --memory: its cgroup's limit (default: the task's "
        "memory_mb, or 2048).",
    )
    address_space_mb: int | None = Field(
        None,
        gt=0,
        le=2**30,
        description="Only where no cgroup can be had: RLIMIT_AS of every process, in MiB (default: the memory).",
    )
    max_processes: int = Field(
        256, gt=0, le=2**22, description="Processes and threads a trial may have (its cgroup's pids.max)."
    )
    max_file_size_mb: int = Field(1024, gt=0, le=2**30, description="RLIMIT_FSIZE: the largest file, in MiB.")
    max_output_bytes: int = Field(
        1_000_000, gt=0, le=2**31 - 1, description="stdout and stderr of one exec are each cut to this many bytes."
    )
    work_dir: str | None = Field(None, min_length=1, description="Where the per-trial dirs go (default: the temp dir).")
    process_scope: Literal["exec", "trial"] = Field(
        "exec", description="`exec`: processes die with their exec; `trial`: they live until the agent phase ends."
    )
    image_cache_dir: str | None = Field(
        None, min_length=1, description="Where Dockerfile-built task images are unpacked (default: the cache)."
    )
    image_max_mb: int = Field(8192, gt=0, le=2**30, description="The largest task image unpacked, in MiB.")
    storage_mb: int | None = Field(
        None, gt=0, le=2**30, description="Disk a trial's own files may take, in MiB (default: the task's, or 10 GiB)."
    )


# What `sandbox_kwargs_problem` checks against: a test sandbox that takes more keywords puts its own model here.
SETTINGS: type[LocalSandboxSettings] = LocalSandboxSettings


def sandbox_kwargs_problem(
    kwargs: dict[str, Any], field: str = "rollout.sandbox.kwargs", settings: type[LocalSandboxSettings] | None = None
) -> str | None:
    """The first bad key of `kwargs` as one line naming `field.<key>`, or None; `settings`: the model to check
    against (default `SETTINGS`)."""
    model = settings or SETTINGS
    try:
        model.model_validate(kwargs)
    except ValidationError as err:
        e = err.errors()[0]
        key = ".".join(str(x) for x in e["loc"])
        if e["type"] == "extra_forbidden":  # the value is not echoed: an unknown key may hold anything
            return f"`{field}.{key}`: not a setting of the local sandbox (it takes {', '.join(model.model_fields)})"
        return f"`{field}.{key}`: {e['msg']} (got {e.get('input')!r})"
    return None
