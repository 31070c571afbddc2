"""A step's trial journal: each finished trial's samples appended as it finishes (`details/<step>/journal.jsonl`),
so a crash loses no finished trial, and the finished step's samples in plan order (`samples.jsonl`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from grpoflow.fileio import append_jsonl, write_jsonl_atomic
from grpoflow.samples import Sample

JOURNAL = "journal.jsonl"  # details/step_<N>/: one Sample per finished trial, appended as each one finishes
SAMPLES = "samples.jsonl"  # details/step_<N>/: every sample of the finished step, in plan order


def read_samples(details_dir: Path) -> list[Sample]:
    """The samples of a finished step (or evaluation), as `collect_step` wrote them."""
    path = Path(details_dir) / SAMPLES
    lines = path.read_text(encoding="utf-8").splitlines()
    return [Sample.model_validate(json.loads(line)) for line in lines if line]  # json reads -Infinity back


def read_journal(details_dir: Path) -> dict[str, list[Sample]]:
    """Finished trials of a step that was interrupted: rollout_id -> the trial's samples (one line per trial, so
    a trial's segments are journaled together or not at all; a torn last line is skipped)."""
    path = Path(details_dir) / JOURNAL
    if not path.exists():
        return {}
    lines = path.read_text(encoding="utf-8").splitlines()
    out: dict[str, list[Sample]] = {}
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)  # json, as written: it reads -Infinity back
            samples = [Sample.model_validate(s) for s in record["samples"]]
        except (ValueError, KeyError, TypeError):
            if i == len(lines) - 1:  # a crash mid-append; the next append cuts it off
                continue
            raise ValueError(f"{path}:{i + 1}: not a valid trial record") from None
        out[record["rollout_id"]] = samples
    return out


def append_trial(details_dir: Path, rollout_id: str, samples: Sequence[Sample]) -> None:
    """One line per trial, so a trial's segments are journaled together or not at all."""
    append_jsonl(
        Path(details_dir) / JOURNAL, {"rollout_id": rollout_id, "samples": [x.model_dump(mode="json") for x in samples]}
    )


def write_samples(details_dir: Path, samples: Sequence[Sample]) -> Path:
    path = Path(details_dir) / SAMPLES
    write_jsonl_atomic(path, (s.model_dump(mode="json") for s in samples))
    return path
