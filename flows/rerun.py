"""The rerun flow: run an earlier train run's exact config again under a new run_id and say whether it
reproduced (metrics.jsonl bytes, final checkpoint weights), after listing what changed in code, packages, data
and model since. On the embedded engine with `engine.deterministic` on, a rerun on the same machine is bit-exact.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.common import RunId, run_events
from flows.train import train_flow
from grpoflow.errors import ConfigError, RunDirError
from grpoflow.fileio import write_json_atomic
from grpoflow.paths import RUN_ID_PATTERN, RunPaths
from grpoflow.run.info import read_run_info, update_run_info
from grpoflow.run.rerun import (
    compare_runs,
    report_markdown,
    verdict_line,
)
from grpoflow.run.resume import load_saved_config
from tasks.provenance import provenance_now_task


def _rerun_id(run_id: str) -> str:
    return f"{run_id[:52]}-rr{secrets.token_hex(3)}"  # within RUN_ID_PATTERN's 63 characters


@flow(name="rerun", flow_run_name="rerun-{run_id}", log_prints=True)
def rerun_flow(run_id: RunId, output_dir: str = "runs", new_run_id: RunId | None = None) -> dict:
    """Run `run_id` again with its recorded config under a new run_id; report whether it reproduced.

    Args:
        run_id: The original run: the name of its dir under `output_dir`.
        output_dir: Directory holding the run dirs; the rerun's dir goes there too.
        new_run_id: The rerun's run_id. Empty: the original's plus `-rr` and a short hash.
    """
    new_id = new_run_id or _rerun_id(run_id)
    if not re.fullmatch(RUN_ID_PATTERN, new_id):
        raise ConfigError(f"new_run_id {new_id!r}: lowercase letters, digits and dashes, at most 63")
    original = RunPaths(Path(output_dir) / run_id)
    new = RunPaths(Path(output_dir) / new_id)
    with run_events("rerun", new_id, new.root) as end:
        old_cfg = load_saved_config(original.root)
        then = read_run_info(original)
        if not then.trains:
            raise RunDirError(
                f"{original.run_info}: run {run_id} was made by the `{then.flow}` flow; only train runs are rerun"
            )
        cfg = old_cfg.model_copy(update={"run_id": new_id, "output_dir": output_dir})
        diffs = then.differences(provenance_now_task(cfg))
        for d in diffs:
            print(f"provenance changed since {run_id}: {d}")
        notes = []
        if not (cfg.engine.bit_exact and cfg.engine.deterministic):
            notes.append(
                "engine.deterministic was off (or the engine is not the embedded one): batched generation "
                "rounds differently from run to run, so a bit-exact rerun is not expected"
            )
        if any(d.startswith("cpu arithmetic:") for d in diffs):
            notes.append(
                "the CPU or MKL's mode differs from the original's: MKL picks its kernels by CPU, so the bits may "
                "differ (values agree within float rounding); MKL_CBWR=COMPATIBLE in both runs gives the same bits "
                "across CPU families, at a cost in speed"
            )
        try:
            train_flow(cfg)
        finally:
            if new.run_info.exists():
                update_run_info(new, rerun_of=run_id)
        report = {
            "run_id": new_id,
            "rerun_of": run_id,
            "deterministic": cfg.engine.deterministic,
            "provenance_differences": diffs,
            "notes": notes,
            **compare_runs(original, new),
        }
        report["verdict"] = verdict_line(report)
        write_json_atomic(new.rerun, report)
        create_markdown_artifact(
            key=f"{new_id}-rerun", markdown=report_markdown(report), description=f"Rerun of {run_id}"
        )
        end.payload.update(rerun_of=run_id, reproduced=report["metrics_identical"] and report["weights_identical"])
        print(report["verdict"])
        return report
