"""`grpoflow` command line: runs the flows with a config built from a file, flags and dotted overrides."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from grpoflow.config import apply_overrides, load_run_config, new_run_id, parse_run_config
from grpoflow.errors import GrpoflowError


def _parse_value(text: str) -> Any:
    """`--set rollout.temperature=0.7`: JSON if it parses (numbers, true, null), else the raw string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _config_from_args(args: argparse.Namespace):
    overrides: dict[str, Any] = {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise GrpoflowError(f"--set {item!r}: expected KEY=VALUE, e.g. rollout.temperature=0.7")
        overrides[key] = _parse_value(value)
    flags = {"run_id": args.run_id, "seed": args.seed, "output_dir": args.output_dir,
             "model.source": args.model, "dataset.path": args.dataset}  # fmt: skip
    overrides.update({k: v for k, v in flags.items() if v is not None})
    if args.config:
        cfg = load_run_config(Path(args.config), overrides)
    else:
        cfg = parse_run_config(apply_overrides({}, overrides), source="command line")
    # Fix the run_id here so the flow run is named after it from its first moment.
    return cfg if cfg.run_id else cfg.model_copy(update={"run_id": new_run_id()})


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="JSON file with a RunConfig (flags and --set override it)")
    p.add_argument("--run-id", help="run id (lowercase letters, digits, dashes); default: timestamp + hash")
    p.add_argument("--seed", type=int)
    p.add_argument("--model", help="smollm2-135m-instruct, a local HF model dir, or a .gguf file")
    p.add_argument("--dataset", help="directory of Harbor tasks, or `builtin`")
    p.add_argument("--output-dir", help="where run dirs go (default: runs)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="dotted override, repeatable")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpoflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in [("main", "the main job on the embedded default (currently: prepare)"),
                        ("prepare", "prepare a run: model, dataset, prompts")]:  # fmt: skip
        _add_run_args(sub.add_parser(name, help=help_))
    args = parser.parse_args(argv)
    try:
        cfg = _config_from_args(args)
        from flows.prepare import prepare_flow  # Prefect import is slow: only after the arguments are valid

        print(f"grpoflow: preparing run {cfg.run_id} (model {cfg.model.source}, dataset {cfg.dataset.path})",
              flush=True)  # fmt: skip
        run = prepare_flow(cfg)
    except GrpoflowError as err:
        print(f"grpoflow: error: {err}", file=sys.stderr)
        return 2
    root = run.paths.root.resolve()
    print(f"grpoflow: run {cfg.run_id} prepared: {run.n_tasks} tasks, prompts {run.n_prompts}")
    print(f"grpoflow: artifacts in {root}  (config.json, run.json, prompts.jsonl)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
