"""Rerun reports: what changed in the world since a run (provenance), and whether its rerun reproduced it.
No Prefect in here.

Reproduced means: metrics.jsonl byte-identical, and the final checkpoint's weights (its *.safetensors) hash the
same. Wall-clock figures live in timings.jsonl and are not compared.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpoflow.fileio import sha256_tree
from grpoflow.paths import RunPaths
from grpoflow.run.resume import complete_steps


def final_weights_sha256(paths: RunPaths) -> tuple[int | None, str | None]:
    """(step, sha256 over its *.safetensors) of the run's last complete checkpoint, or (None, None)."""
    steps = complete_steps(paths)
    if not steps:
        return None, None
    return steps[-1], sha256_tree(paths.checkpoint(steps[-1]), "*.safetensors")


def first_metrics_difference(a: Path, b: Path) -> str | None:
    """None when the two metrics.jsonl are byte-identical; else where they first differ (step and key)."""
    da = a.read_bytes() if a.exists() else b""
    db = b.read_bytes() if b.exists() else b""
    if da == db:
        return None
    la, lb = da.splitlines(), db.splitlines()
    for i, (x, y) in enumerate(zip(la, lb)):
        if x == y:
            continue
        try:
            rx, ry = json.loads(x), json.loads(y)
        except json.JSONDecodeError:
            return f"line {i + 1} differs (not valid JSON)"
        step = rx.get("step", i)
        for key in list(rx) + [k for k in ry if k not in rx]:
            if json.dumps(rx.get(key)) != json.dumps(ry.get(key)):
                return f"step {step}: `{key}` {rx.get(key)!r} -> {ry.get(key)!r}"
        return f"step {step}: same values, different bytes (key order or formatting)"
    return f"the original has {len(la)} steps, the rerun {len(lb)}"


def first_tensor_difference(a: Path, b: Path) -> str | None:
    """None when two checkpoint dirs hold the same tensors bit for bit; else the first differing tensor in name
    order (or one only one side has) and its largest absolute difference."""
    from safetensors import safe_open  # the report reads weights only when they differ

    def tensors(ckpt: Path) -> dict[str, tuple[Path, str]]:
        out = {}
        for file in sorted(ckpt.glob("*.safetensors")):
            with safe_open(file, "pt") as f:
                out.update({name: (file, name) for name in f.keys()})
        return out

    ta, tb = tensors(a), tensors(b)
    for name in sorted(set(ta) | set(tb)):
        if name not in ta or name not in tb:
            return f"`{name}` only in the {'original' if name in ta else 'rerun'}"
        with safe_open(ta[name][0], "pt") as fa, safe_open(tb[name][0], "pt") as fb:
            x, y = fa.get_tensor(name), fb.get_tensor(name)
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"`{name}`: {x.dtype}{list(x.shape)} -> {y.dtype}{list(y.shape)}"
        differ = x.reshape(-1).view(_bits(x)) != y.reshape(-1).view(_bits(y))  # (numel,)
        if differ.any():
            delta = (x.double() - y.double()).abs().max().item()
            return f"`{name}`: {int(differ.sum())} of {x.numel()} values differ, by up to {delta:.3g}"
    return None


def _bits(t):
    """An integer dtype of the tensor's width: bit equality, so that -0.0 and 0.0 (or two NaNs) are told apart."""
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


def compare_runs(original: RunPaths, rerun: RunPaths) -> dict[str, Any]:
    """Metrics bytes and final weights of a run and its rerun; where the weights differ, the first tensor that
    does."""
    diff = first_metrics_difference(original.metrics, rerun.metrics)
    step_a, hash_a = final_weights_sha256(original)
    step_b, hash_b = final_weights_sha256(rerun)
    tensor_diff = None
    if hash_a is not None and hash_b is not None and hash_a != hash_b and step_a == step_b:
        tensor_diff = first_tensor_difference(original.checkpoint(step_a), rerun.checkpoint(step_b))
    return {
        "metrics_identical": diff is None,
        "metrics_first_difference": diff,
        "final_checkpoint": {
            "original": {"step": step_a, "weights_sha256": hash_a},
            "rerun": {"step": step_b, "weights_sha256": hash_b},
        },
        "weights_identical": hash_a is not None and (step_a, hash_a) == (step_b, hash_b),
        "weights_first_difference": tensor_diff,
    }


def verdict_line(report: dict[str, Any]) -> str:
    """`rerun <new> of <old>: reproduced bit-exact`, or what differed."""
    head = f"rerun {report['run_id']} of {report['rerun_of']}"
    if report["metrics_identical"] and report["weights_identical"]:
        return f"{head}: reproduced bit-exact"
    what = []
    if not report["metrics_identical"]:
        what.append(f"metrics.jsonl differs ({report['metrics_first_difference']})")
    if not report["weights_identical"]:
        fc = report["final_checkpoint"]
        first = report.get("weights_first_difference")
        what.append(
            f"final weights differ (step {fc['original']['step']} {str(fc['original']['weights_sha256'])[:12]}"
            f" vs step {fc['rerun']['step']} {str(fc['rerun']['weights_sha256'])[:12]}"
            + (f"; first {first}" if first else "")
            + ")"
        )
    return f"{head}: NOT reproduced: " + "; ".join(what)


def report_markdown(report: dict[str, Any]) -> str:
    fc = report["final_checkpoint"]
    lines = [
        f"# Rerun `{report['run_id']}` of `{report['rerun_of']}`",
        "",
        f"**{verdict_line(report)}**",
        "",
        "| check | result |",
        "|---|---|",
        f"| metrics.jsonl | {'identical' if report['metrics_identical'] else report['metrics_first_difference']} |",
        f"| final weights (original) | step {fc['original']['step']} `{fc['original']['weights_sha256']}` |",
        f"| final weights (rerun) | step {fc['rerun']['step']} `{fc['rerun']['weights_sha256']}` |",
        f"| deterministic engine | {report['deterministic']} |",
        "",
        "## Provenance then vs now",
        "",
    ]
    lines += [f"- {d}" for d in report["provenance_differences"]] or ["- no difference"]
    if report.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"
