"""`grpoflow` command line: runs the flows with a config built from a preset, a file, flags and dotted overrides
(each layer overrides the one before, in that order)."""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from grpoflow.config import apply_overrides, load_run_config, parse_run_config
from grpoflow.errors import ConfigError, GrpoflowError, RunDirError
from grpoflow.paths import RUN_ID_PATTERN, RunPaths, new_run_id, run_dir_problems
from grpoflow.prepare.presets import PRESETS, layered_run_config
from grpoflow.train.memory import KNOWN_SHAPES


def _parse_value(text: str) -> Any:
    """`--set rollout.sampling.temperature=0.7`: JSON if it parses (numbers, true, null), else the raw string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _set_overrides(items: list[str] | None) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise GrpoflowError(f"--set {item!r}: expected KEY=VALUE, e.g. rollout.sampling.temperature=0.7")
        overrides[key] = _parse_value(value)
    return overrides


def _config_from_args(args: argparse.Namespace):
    overrides = _set_overrides(args.set)
    flags = {
        "run_id": args.run_id,
        "seed": args.seed,
        "output_dir": args.output_dir,
        "model.source": args.model,
        "dataset.path": args.dataset,
    }
    overrides.update({k: v for k, v in flags.items() if v is not None})
    preset = args.preset or (MAIN_PRESET if _is_embedded_default(args) else None)
    if preset:
        cfg = layered_run_config(preset, Path(args.config) if args.config else None, overrides)
    elif args.config:
        cfg = load_run_config(Path(args.config), overrides)
    else:
        cfg = parse_run_config(apply_overrides({}, overrides), source="command line")
    # Fix the run_id here so the flow run is named after it from its first moment.
    return cfg if cfg.run_id else cfg.model_copy(update={"run_id": new_run_id()})


MAIN_PRESET = "embedded-default"  # what `grpoflow main` starts from on the built-in model and tasks


def _is_embedded_default(args: argparse.Namespace) -> bool:
    """`main` on the built-in model and tasks: the recipe is tuned for those, so another model, dataset or config
    file starts from the plain defaults (as `train` does)."""
    return args.command == "main" and not (args.config or args.model or args.dataset)


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        metavar="NAME",
        help=f"named recipe to start from ({', '.join(PRESETS)}); --config, flags and --set override it",
    )
    p.add_argument("--config", help="JSON file with a RunConfig (flags and --set override it)")
    p.add_argument("--run-id", help="run id (lowercase letters, digits, dashes); default: timestamp + hash")
    p.add_argument("--seed", type=int)
    p.add_argument("--model", help="smollm2-135m-instruct, a local HF model dir, or a .gguf file")
    p.add_argument("--dataset", help="directory of Harbor tasks, `builtin` (generated families) or `builtin-fixed`")
    p.add_argument("--output-dir", help="where run dirs go (default: runs)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="dotted override, repeatable")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpoflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in [
        ("main", f"the main job: the train flow, starting from the `{MAIN_PRESET}` preset"),
        ("train", "the train flow: prepare, then rollout -> evaluate -> GRPO step per step"),
        ("evaluate", "the evaluate flow: k trials per prompt of a split (the eval split), no training"),
        ("prepare", "prepare a run: model, dataset, prompts"),
    ]:
        _add_run_args(p := sub.add_parser(name, help=help_))
        if name == "evaluate":
            p.add_argument("--from-run", metavar="RUN_ID", help="evaluate this train run's final checkpoint")
            p.add_argument(
                "--split", choices=("eval", "train", "all"), default="eval", help="which prompts (default: eval)"
            )
    _add_run_args(p := sub.add_parser("plan", help="the run's GPU placement and memory per trainer rank, no run"))
    p.add_argument("--shape", help=f"plan for a model of this size instead of the run's: {', '.join(KNOWN_SHAPES)}")
    p.add_argument("--ranks", help="trainer rank counts to compare, e.g. 1,2,4,8 (default: cluster.train_ranks)")
    p.add_argument("--gpus", type=int, help="GPUs of the machine to place on (default: this machine's)")
    p.add_argument("--gpu-gb", type=float, default=141.0, help="memory of one GPU in GB (default: 141, an H200)")
    p = sub.add_parser("resume", help="resume a killed train run under its run_id, from its last complete step")
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument("--output-dir", default="runs", help="where run dirs are (default: runs)")
    p = sub.add_parser("rerun", help="run an earlier run's config again under a new run_id and compare")
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument("--output-dir", default="runs", help="where run dirs are (default: runs)")
    p.add_argument("--run-id", dest="new_run_id", metavar="NEW", help="the rerun's run_id (default: RUN_ID-rr<hash>)")
    p = sub.add_parser("tasks", help="task health across the runs in an output dir: pass rates per run, flags")
    p.add_argument("--output-dir", default="runs", help="where run dirs are (default: runs)")
    p.add_argument(
        "--regrade",
        metavar="RUN_ID",
        help="first regrade that run's stored trials with Harbor (its verifier again on each trial's recorded "
        "workdir: trials of a run with report.regrade_per_task > 0) and record the verdicts",
    )
    p.add_argument(
        "--per-task",
        type=int,
        metavar="K",
        help="with --regrade: trials regraded per task beyond those of the run's first and last evaluations, which are regraded "
        "whole (default: 2)",
    )
    p.add_argument(
        "--validate",
        action="store_true",
        help="run the dataset gate on --dataset instead (as prepare does): each task's oracle (dataset."
        "gate_oracle_runs times) and a no-op agent, in the sandbox of rollout.sandbox.backend; print the tasks left "
        "out and why (verdicts cached)",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="with --validate: run every task again, reading no cached verdict (the new ones are cached)",
    )
    p.add_argument("--dataset", help="with --validate: directory of Harbor tasks, `builtin` or `builtin-fixed`")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="with --validate: dotted override, repeatable")
    p = sub.add_parser("cache", help="the cache of Dockerfile-built task images: `gc` removes the least recently used")
    p.add_argument("action", choices=["gc"])
    p.add_argument(
        "--max-mb", type=int, default=None, help="keep at most this many MiB (default: the automatic budget)"
    )
    p.add_argument("--image-cache-dir", help="the image cache (default: <GRPOFLOW_CACHE>/images)")
    return parser


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the main thread is, as Ctrl-C raises KeyboardInterrupt: the command's
    cleanups (its sandboxes, its temporary dirs, Prefect's temporary server) run before it ends, and asyncio lets
    it through as it does Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _stop_signals_raised() -> Iterator[None]:
    """SIGTERM and SIGHUP raise `Stopped` for the block (in the main thread: only there can Python take a signal),
    and the handlers before it are back after (`main` may be called in-process)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise Stopped(signum)

    # a signal ignored on purpose (`nohup` ignores SIGHUP) stays ignored
    watched = [sig for sig in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(sig) is not signal.SIG_IGN]
    before = {sig: signal.signal(sig, stop) for sig in watched}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _stopped_line(args: argparse.Namespace, signum: int) -> str:
    """The last line of a command a signal stopped: what to run to continue a train run that left a run dir."""
    name = signal.Signals(signum).name
    run_id, output_dir = getattr(args, "run_id", None), getattr(args, "output_dir", None) or "runs"
    if (
        args.command in ("main", "train", "resume")
        and run_id
        and (RunPaths(Path(output_dir) / run_id).config).is_file()
    ):
        return (
            f"grpoflow: run {run_id} stopped by {name}; `grpoflow resume {run_id} --output-dir {output_dir}` "
            "continues it from its last complete step"
        )
    if args.command in ("main", "train", "evaluate", "prepare") and run_id:
        return f"grpoflow: run {run_id} stopped by {name}; nothing to resume: start it again"
    return f"grpoflow: {args.command} stopped by {name}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Prefect says so itself when its home cannot be made, then waits out its server's start: ours is one line.
    warnings.filterwarnings("ignore", message="Failed to create the Prefect home directory")
    try:
        with _stop_signals_raised():
            return _command(args)
    except KeyboardInterrupt as stop:  # Ctrl-C, or a Stopped signal
        sys.stdout.flush()
        signum = stop.signum if isinstance(stop, Stopped) else signal.SIGINT
        print(_stopped_line(args, signum), file=sys.stderr)
        return 128 + signum


def _command(args: argparse.Namespace) -> int:
    if args.command in ("resume", "rerun"):
        return _resume_or_rerun(args)
    if args.command == "tasks" and (args.validate or args.dataset or args.fresh):
        return _validate(args)
    if args.command == "tasks":
        return _tasks(Path(args.output_dir), args.regrade, args.per_task)
    if args.command == "plan":
        return _plan(args)
    if args.command == "cache":
        return _cache_gc(args)
    try:
        cfg = _config_from_args(args)
        args.run_id, args.output_dir = cfg.run_id, str(cfg.output_dir)  # the run a stop signal names
        preset = f"preset {args.preset or MAIN_PRESET}, " if args.preset or _is_embedded_default(args) else ""
        print(
            f"grpoflow: {args.command} run {cfg.run_id} ({preset}model {cfg.model.source}, dataset "
            f"{cfg.dataset.path}, engine {cfg.engine.backend}, sandbox {cfg.rollout.sandbox.backend})",
            flush=True,
        )
        if problems := run_dir_problems(cfg.output_dir, cfg.run_id):  # said before Prefect's slow start
            raise RunDirError("; ".join(problems))
        # Prefect only now: it is slow to import
        _run_flow(args.command, cfg, getattr(args, "from_run", None), getattr(args, "split", "eval"))
    except GrpoflowError as err:
        sys.stdout.flush()  # what was printed comes first, also when stdout is a pipe
        print(f"grpoflow: error: {err}", file=sys.stderr)
        return 2
    root = (Path(cfg.output_dir) / cfg.run_id).resolve()
    print(f"grpoflow: run {cfg.run_id} finished; artifacts in {root}")
    for name in sorted(p.name + ("/" if p.is_dir() else "") for p in root.iterdir()):
        print(f"  {name}")
    return 0


def _cache_gc(args: argparse.Namespace) -> int:
    """`grpoflow cache gc`: the image cache down to its budget, least recently used first; what went, what stays."""
    from grpoflow.embedded.sandbox.images import DEFAULT_CACHE_MAX_MB, collect
    from grpoflow.paths import default_cache_dir

    max_mb = DEFAULT_CACHE_MAX_MB if args.max_mb is None else args.max_mb
    if max_mb < 0:
        print(f"grpoflow: error: --max-mb {max_mb}: not a size", file=sys.stderr)
        return 2
    where = Path(args.image_cache_dir) if args.image_cache_dir else default_cache_dir() / "images"
    done = collect(where, max_mb * 2**20)
    for digest, size in done.removed:
        print(f"removed {digest} ({size / 2**20:.0f} MiB)")
    for digest in done.busy:
        print(f"kept {digest}: in use by a sandbox, or used in the last minutes")
    print(f"grpoflow cache gc: {where}: {len(done.removed)} images removed, {done.kept_bytes / 2**20:.0f} MiB kept")
    return 0


def _plan(args: argparse.Namespace) -> int:
    """`grpoflow plan`: where the run's parts would sit on the GPUs and what a trainer rank holds (no run)."""
    from grpoflow.placement import machine_gpus, plan_gpus
    from grpoflow.prepare.model import prepare_model
    from grpoflow.train.memory import ModelShape, plan_table, train_setup

    try:
        cfg = _config_from_args(args)
        gpus = machine_gpus() if args.gpus is None else args.gpus
        print(f"grpoflow plan: {plan_gpus(cfg, gpus).describe()}")
        if args.shape:
            if args.shape not in KNOWN_SHAPES:
                raise ConfigError(f"--shape {args.shape}: not one of {', '.join(KNOWN_SHAPES)}")
            shape, name = KNOWN_SHAPES[args.shape], args.shape
        else:
            shape, name = ModelShape.from_dir(prepare_model(cfg.model.source).path), cfg.model.source
        ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else [cfg.cluster.train_ranks]
        setups = {f"{r} rank{'s' * (r > 1)}": train_setup(cfg, r, on_gpu=gpus > 0) for r in ranks}
        first = next(iter(setups.values()))
        what = f"LoRA r={first.lora_rank}" if first.lora_rank else "full fine-tuning"
        print(
            f"model {name} ({shape.params / 1e9:.2f}B parameters), {what}, {first.precision} compute, "
            f"sharding {first.sharding}, micro-batches of {first.micro_batch_tokens} tokens, samples up to "
            f"{first.longest_sample_tokens} tokens, activation checkpointing {_recomputed(first)}, KL reference "
            f"{'on' if first.kl else 'off'}"
        )
        for line in plan_table(shape, setups, args.gpu_gb if gpus > 0 or args.gpus is not None else None):
            print(line)
    except GrpoflowError as err:
        sys.stdout.flush()
        print(f"grpoflow: error: {err}", file=sys.stderr)
        return 2
    return 0


def _recomputed(setup) -> str:
    if setup.checkpointing:
        return "on"
    above = setup.checkpoint_above_tokens
    return f"above {above} tokens" if above is not None else "off"


def _resume_or_rerun(args: argparse.Namespace) -> int:
    try:
        for flag, value in (("RUN_ID", args.run_id), ("--run-id", getattr(args, "new_run_id", None))):
            if value is not None and not re.fullmatch(RUN_ID_PATTERN, value):
                raise ConfigError(f"{flag} {value!r}: a run id is lowercase letters, digits and dashes (at most 63)")
        if not (Path(args.output_dir) / args.run_id).is_dir():  # said before Prefect's slow start
            raise RunDirError(f"run dir {Path(args.output_dir) / args.run_id} does not exist")
        if args.command == "resume":
            from flows.resume import resume_flow
            from flows.server import command_server

            print(f"grpoflow: resume run {args.run_id} (in {args.output_dir})", flush=True)
            with command_server():
                resume_flow(args.run_id, args.output_dir)
            run_id = args.run_id
        else:
            from flows.rerun import rerun_flow
            from flows.server import command_server

            print(f"grpoflow: rerun of run {args.run_id} (in {args.output_dir})", flush=True)
            with command_server():
                report = rerun_flow(args.run_id, args.output_dir, args.new_run_id)
            run_id = report["run_id"]
            for diff in report["provenance_differences"]:
                print(f"grpoflow: changed since {args.run_id}: {diff}")
            for note in report["notes"]:
                print(f"grpoflow: note: {note}")
            print(f"grpoflow: {report['verdict']}")
    except GrpoflowError as err:
        sys.stdout.flush()  # what was printed comes first, also when stdout is a pipe
        print(f"grpoflow: error: {err}", file=sys.stderr)
        return 2
    print(f"grpoflow: run {run_id} finished; artifacts in {(Path(args.output_dir) / run_id).resolve()}")
    return 0


def _tasks(output_dir: Path, regrade: str | None = None, per_task: int | None = None) -> int:
    from grpoflow.run.health import health_markdown, task_health

    if not output_dir.is_dir():
        print(f"grpoflow: error: output dir {output_dir} does not exist", file=sys.stderr)
        return 2
    if regrade is None and per_task is not None:
        print("grpoflow: error: --per-task goes with --regrade RUN_ID", file=sys.stderr)
        return 2
    if regrade is not None:
        try:
            if not re.fullmatch(RUN_ID_PATTERN, regrade):
                raise ConfigError(
                    f"--regrade {regrade!r}: a run id is lowercase letters, digits and dashes (at most 63)"
                )
            _regrade(output_dir / regrade, 2 if per_task is None else per_task)
        except GrpoflowError as err:
            print(f"grpoflow: error: {err}", file=sys.stderr)
            return 2
    unreadable: list[str] = []
    run_ids, tasks = task_health(output_dir, unreadable)
    if not run_ids:
        print(f"grpoflow: no runs with trials in {output_dir}")
        return 0
    print(health_markdown(run_ids, tasks, unreadable), end="")
    return 0


def _validate(args: argparse.Namespace) -> int:
    """`grpoflow tasks --validate --dataset PATH`: the dataset gate alone, its table printed; no run dir. Exit 0
    when a task is admitted, 2 (and one error line) when none is or the input is bad."""
    from grpoflow.run.start import gate_dataset

    try:
        if args.fresh and not args.validate:
            raise ConfigError("--fresh goes with --validate: `grpoflow tasks --validate --fresh --dataset PATH`")
        if not (args.validate and args.dataset):
            raise ConfigError("--validate and --dataset PATH go together: `grpoflow tasks --validate --dataset PATH`")
        if args.regrade is not None or args.per_task is not None:
            raise ConfigError("--validate does not go with --regrade or --per-task")
        overrides = _set_overrides(args.set) | {"dataset.path": args.dataset, "dataset.validate": True}
        cfg = parse_run_config(apply_overrides({}, overrides), source="command line")
        dataset, _ = gate_dataset(cfg, fresh=args.fresh)  # prints the table
    except GrpoflowError as err:
        sys.stdout.flush()  # the table comes first, also when stdout is a pipe
        print(f"grpoflow: error: {err}", file=sys.stderr)
        return 2
    print(f"grpoflow: {len(dataset.tasks)} tasks of {dataset.root} would train and evaluate")
    return 0


def _regrade(root: Path, per_task: int) -> None:
    """Regrade up to `per_task` stored trials of each task of the run at `root`, in the sandboxes its config
    names, and count the verdicts into its tasks.json (what task health reads)."""
    from grpoflow.credentials import export_sandbox_key
    from grpoflow.run.health import write_run_tasks
    from grpoflow.run.regrade import regrade_run, regrade_summary
    from grpoflow.run.resume import load_saved_config, run_lock

    if per_task < 1:
        raise ConfigError(f"--per-task {per_task}: regrade at least 1 trial per task")
    cfg = load_saved_config(root)
    export_sandbox_key(cfg.rollout.sandbox.backend, cfg.rollout.sandbox.key_file())
    with run_lock(root):  # not while the run itself runs (it regrades at its end)
        regrades = regrade_run(root, cfg, per_task)
        if all(r.recorded is None for r in regrades):  # only rows of unreadable records, or none at all
            raise RunDirError(
                f"run {root.name} has no graded trial that recorded its workdir (a run with "
                "report.regrade_per_task > 0 records them): nothing to regrade"
            )
        write_run_tasks(root)
    head, *rows = regrade_summary(regrades)
    print(f"grpoflow: run {root.name}: {head}")
    for line in rows:
        print(f"grpoflow: {line}")


def _run_flow(command: str, cfg, from_run: str | None = None, split: str = "eval") -> None:
    kwargs = {}
    if command == "prepare":
        from flows.prepare import prepare_flow as flow
    elif command == "evaluate":
        from flows.evaluate import evaluate_flow as flow

        kwargs["from_run"] = from_run
        kwargs["split"] = split
    else:
        from flows.train import train_flow as flow
    from flows.server import command_server  # after the flow's modules: flows.common sets the startup wait

    with command_server():  # stopped before the command's last line; dies with this process
        flow(cfg, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
