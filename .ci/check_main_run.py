"""CI: what a newcomer's short main job must have left: every step's row, the base and final evaluations with
their intervals, the curves, the before/after lines in its output.

    python .ci/check_main_run.py RUN_DIR MAIN_LOG
"""

import json
import sys
from pathlib import Path


def main(run_dir: Path, log: Path) -> None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = json.loads((run_dir / "config.json").read_text())["train"]["steps"]
    problems = []
    if [r["step"] for r in rows] != list(range(steps + 1)):
        problems.append(f"metrics.jsonl rows are steps {[r['step'] for r in rows]}, not 0..{steps}")
    for r in (rows[0], rows[-1]):
        if "eval/trained/pass_at_1_ci95_low" not in r:
            problems.append(f"metrics.jsonl step {r['step']}: no evaluation with its interval")
    if "eval/trained/pass_at_1_change" not in rows[-1]:
        problems.append("metrics.jsonl: the final evaluation has no change since the base policy")
    if not (run_dir / "summary.png").stat().st_size:
        problems.append("summary.png is empty")
    if "before -> after training" not in log.read_text():
        problems.append(f"{log}: the main job did not print its before/after evaluation")
    if problems:
        sys.exit("ci: main job: " + "; ".join(problems))
    print(f"ci: main job ok: {len(rows)} metrics rows, evaluations before and after, summary.png")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
