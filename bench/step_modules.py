"""How many of grpoflow's modules one training step enters, prompt to checkpoint: the core's reach, measured.

    .venv/bin/python bench/step_modules.py [--steps 2] [--keep DIR]

Runs the main job's preset (the embedded engine, the built-in tasks, the bubblewrap sandbox) through the core
loop without Prefect (`train_steps` with `CORE_STAGES`), shortened to a few prompts and no evaluation, with a
profile hook on every thread of this process. Per step it prints the modules of `grpoflow` whose functions ran
between the start and the end of `StepLoop.step` (the step's selection, rollout, filter, update, checkpoint and
sync; the rollout of a step run ahead counts in the step that started it), grouped by stage package, and how many
times the step crossed from one package into another. Code in other processes (the embedded engine's server, the
sandboxes, ranks > 0) is reached over HTTP or a pipe and is not counted: it is not a module the step enters.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpoflow.prepare.presets import load_preset  # noqa: E402
from grpoflow.run import loop as loop_mod  # noqa: E402
from grpoflow.run.start import prepare_run  # noqa: E402
from grpoflow.train.trainer import load_trainer  # noqa: E402

PRESET = "embedded-default"


class ModuleTrace:
    """The grpoflow modules whose functions are called while `on` is set, and the package-to-package calls."""

    def __init__(self) -> None:
        self.on = False
        self.modules: Counter[str] = Counter()
        self.crossings: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def hook(self, frame, event, arg):
        if event != "call" or not self.on:
            return
        name = frame.f_globals.get("__name__", "")
        if not name.startswith("grpoflow"):
            return
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back is not None else ""
        with self._lock:
            self.modules[name] += 1
            if caller.startswith("grpoflow") and package(caller) != package(name):
                self.crossings[(package(caller), package(name))] += 1

    def take(self) -> tuple[Counter[str], Counter[tuple[str, str]]]:
        with self._lock:
            out = (self.modules, self.crossings)
            self.modules, self.crossings = Counter(), Counter()
        return out


def package(module: str) -> str:
    """`grpoflow.train.sync` -> `train`; a top-level module (`grpoflow.config`) is its own package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "grpoflow"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--keep", type=Path, help="write the run dir here (default: a temporary dir, removed at the end)")
    args = ap.parse_args()

    work = args.keep or Path(tempfile.mkdtemp(prefix="step-modules-"))
    cfg = load_preset(
        PRESET,
        {
            "output_dir": str(work),
            "train.steps": args.steps,
            "rollout.prompts_per_step": 2,
            "rollout.n_samples_per_prompt": 2,
            "train.eval.samples_per_prompt": 0,
        },
    )
    run = prepare_run(cfg)
    trainer = load_trainer(run.model.path, cfg.train, seed=cfg.seed)

    trace = ModuleTrace()
    per_step: list[tuple[int, Counter[str], Counter[tuple[str, str]]]] = []
    step_fn = loop_mod.StepLoop.step

    def traced_step(self, step):
        trace.take()
        trace.on = True
        try:
            return step_fn(self, step)
        finally:
            trace.on = False
            per_step.append((step, *trace.take()))

    loop_mod.StepLoop.step = traced_step
    threading.setprofile_all_threads(trace.hook)
    try:
        loop_mod.train_steps(cfg, run, trainer)
    finally:
        threading.setprofile_all_threads(None)
        loop_mod.StepLoop.step = step_fn
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)

    print(f"preset {PRESET}, {args.steps} steps" + (f", run dir {cfg.run_dir}" if args.keep else ""))
    for step, modules, crossings in per_step:
        by_package: dict[str, list[str]] = defaultdict(list)
        for m in sorted(modules):
            by_package[package(m)].append(m.split(".", 2)[-1] if m.count(".") > 1 else m)
        print(
            f"step {step}: {len(modules)} modules in {len(by_package)} packages, "
            f"{sum(crossings.values())} calls across packages ({len(crossings)} distinct edges)"
        )
        for pkg in sorted(by_package):
            print(f"  {pkg:<10} {len(by_package[pkg]):>3}  {', '.join(by_package[pkg])}")
        back = sorted(f"{a}->{b}" for a, b in crossings)
        print(f"  edges: {' '.join(back)}")


if __name__ == "__main__":
    main()
