"""`python -m flows.serve`: every deployment of `deployments/prefect.yaml` served from this one process.

The single-machine route: no work pool and no worker. The same names, schedules, parameters, descriptions and
schema enforcement as `prefect deploy --all`, read from the same file, so the two routes cannot drift. Runs start
in the repository root (as the worker's pull step does), so a relative `output_dir` means the same directory.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from grpoflow.errors import GrpoflowError

ROOT = Path(__file__).resolve().parents[1]
DEPLOYMENTS_FILE = ROOT / "deployments" / "prefect.yaml"


@dataclass(frozen=True)
class ScheduleSpec:
    cron: str
    timezone: str | None = None
    active: bool = True


@dataclass(frozen=True)
class DeploymentSpec:
    """One entry of prefect.yaml's `deployments:`, as far as both routes use it."""

    name: str
    entrypoint: str  # `flows/train.py:train_flow`, relative to the repository root
    description: str | None = None
    tags: list[str] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
    schedules: list[ScheduleSpec] = field(default_factory=list)
    triggers: list[dict[str, Any]] = field(default_factory=list)  # event triggers, as prefect.yaml writes them
    enforce_parameter_schema: bool = True
    concurrency_limit: int | None = None
    env: dict[str, str] = field(default_factory=dict)  # its work pool's job variables' `env`: set in its flow runs

    @property
    def entrypoint_file(self) -> Path:
        return ROOT / self.entrypoint.split(":", 1)[0]


def read_specs(path: Path = DEPLOYMENTS_FILE) -> list[DeploymentSpec]:
    """The deployments declared in a prefect.yaml; one-line errors naming the file and deployment."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GrpoflowError(f"{path}: deployments file not found") from None
    except yaml.YAMLError as err:
        raise GrpoflowError(f"{path}: not valid YAML: {err}".replace("\n", " ")) from None
    specs = []
    for i, d in enumerate((data or {}).get("deployments") or []):
        where = f"{path}: deployments[{i}]"
        if not isinstance(d, dict) or not d.get("name") or not d.get("entrypoint"):
            raise GrpoflowError(f"{where}: needs a `name` and an `entrypoint`")
        schedules = []
        for s in d.get("schedules") or []:
            if not isinstance(s, dict) or set(s) - {"cron", "timezone", "active"} or "cron" not in s:
                raise GrpoflowError(f"{where} ({d['name']}): only cron schedules (cron, timezone, active) are served")
            schedules.append(ScheduleSpec(s["cron"], s.get("timezone"), s.get("active", True)))
        triggers = list(d.get("triggers") or [])
        if any(not isinstance(t, dict) or t.get("type") != "event" for t in triggers):
            raise GrpoflowError(f"{where} ({d['name']}): only event triggers (type: event) are served")
        specs.append(
            DeploymentSpec(
                name=d["name"],
                entrypoint=d["entrypoint"],
                description=d.get("description"),
                tags=list(d.get("tags") or []),
                parameters=dict(d.get("parameters") or {}),
                schedules=schedules,
                triggers=triggers,
                enforce_parameter_schema=d.get("enforce_parameter_schema", True),
                concurrency_limit=d.get("concurrency_limit"),
                env={
                    k: str(v)
                    for k, v in (((d.get("work_pool") or {}).get("job_variables") or {}).get("env") or {}).items()
                },
            )
        )
    if not specs:
        raise GrpoflowError(f"{path}: declares no deployments")
    return specs


def build_deployments(specs: list[DeploymentSpec]):
    """`RunnerDeployment`s for `prefect.serve`. Call from the repository root: Prefect records each flow's
    entrypoint relative to the working directory, which makes them equal to the yaml's."""
    from prefect.events import DeploymentEventTrigger
    from prefect.flows import load_flow_from_entrypoint
    from prefect.schedules import Cron

    missing = [f"{s.name} ({s.entrypoint})" for s in specs if not s.entrypoint_file.is_file()]
    if missing:
        raise GrpoflowError(f"{DEPLOYMENTS_FILE}: entrypoint file missing for {', '.join(missing)}")
    out = []
    for s in specs:
        flow = load_flow_from_entrypoint(s.entrypoint)
        out.append(
            flow.to_deployment(
                name=s.name,
                description=s.description,
                tags=s.tags,
                parameters=s.parameters,
                schedules=[Cron(c.cron, timezone=c.timezone, active=c.active) for c in s.schedules],
                triggers=[DeploymentEventTrigger(**t) for t in s.triggers],
                enforce_parameter_schema=s.enforce_parameter_schema,
                concurrency_limit=s.concurrency_limit,
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", type=Path, default=DEPLOYMENTS_FILE, help="prefect.yaml to read")
    parser.add_argument("--only", action="append", metavar="NAME", help="serve only this deployment (repeatable)")
    parser.add_argument("--limit", type=int, help="most flow runs at once (default: no limit)")
    parser.add_argument("--list", action="store_true", help="print the deployments and exit")
    args = parser.parse_args(argv)
    try:
        specs = read_specs(args.file)
        if args.only:
            unknown = sorted(set(args.only) - {s.name for s in specs})
            if unknown:
                raise GrpoflowError(
                    f"--only {', '.join(unknown)}: not in {args.file} ({', '.join(s.name for s in specs)})"
                )
            specs = [s for s in specs if s.name in args.only]
        if args.list:
            for s in specs:
                on = [f"on {', '.join(sorted(t.get('expect') or []))}" for t in s.triggers]
                when = "; ".join([*(f"{c.cron} {c.timezone or 'UTC'}" for c in s.schedules), *on]) or "manual"
                print(f"{s.name:18} {s.entrypoint:36} {when}")
            return 0
        os.chdir(ROOT)
        deployments = build_deployments(specs)
    except GrpoflowError as err:
        print(f"grpoflow serve: error: {err}", file=sys.stderr)
        return 2
    from prefect import serve

    for spec in specs:  # served flow runs are this process's children: they see what a worker gives its runs
        for key, value in spec.env.items():
            os.environ.setdefault(key, value)
    serve(*deployments, limit=args.limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
