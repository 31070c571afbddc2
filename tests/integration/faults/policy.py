"""A test-only policy that solves a test-only task half the time, so GRPO groups have reward spread and every
step really updates the weights (the tiny random model never earns a reward, and a step without advantages
leaves weights and optimizer untouched — nothing for resume or rerun tests to get wrong).

`fence_policy` turns the tiny model into a bigram sampler: attention and MLP outputs are zeroed, so the last
hidden state is the current token's embedding; embeddings of a few tokens are basis vectors, and the head maps
each to its successor with a large logit. After the prompt's final "\\n" it writes "```bash\\n" (p = 1/2) or a
command at once; after "```bash\\n" (the same "\\n" token) a command: `touch ok` or `ls`, then <|im_end|>. Only
a reply with exactly one fence runs a command, so reward 1 (`/app/ok` exists) comes with p ~ 1/8 per turn.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from grpoflow.prepare.dataset import builtin_dataset_path

BIG = 24.0


def fence_policy(tiny_model_dir: Path, out_dir: Path) -> Path:
    from transformers import AutoTokenizer

    out_dir = Path(out_dir)
    if (out_dir / "model.safetensors").exists():
        return out_dir
    shutil.copytree(tiny_model_dir, out_dir)
    tok = AutoTokenizer.from_pretrained(out_dir)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    (nl,) = enc("\n")
    fence, bash = enc("```bash")
    touch, ls = enc("touch ok"), enc("ls")
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    # successor logits (relative) per source token
    succ: dict[int, dict[int, float]] = {
        nl: {fence: 1.0, touch[0]: 0.0, ls[0]: 0.0},
        fence: {bash: 0.0},
        bash: {nl: 0.0},
    }
    for path in (touch, ls):
        for a, b in zip(path, path[1:] + [eos]):
            succ.setdefault(a, {})[b] = 0.0
    w = load_file(out_dir / "model.safetensors")
    hidden = w["model.embed_tokens.weight"].shape[1]
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight", "o_proj.bias", "down_proj.bias")):
            w[name].zero_()
    w["model.norm.weight"].fill_(1.0)
    head = torch.zeros_like(w["lm_head.weight"])
    for k, (src, nexts) in enumerate(succ.items()):
        basis = torch.zeros(hidden)
        basis[k] = 1.0
        w["model.embed_tokens.weight"][src] = basis  # RMSNorm makes it sqrt(hidden) * basis
        for dst, rel in nexts.items():
            head[dst, k] = (BIG + rel) / hidden**0.5
    w["lm_head.weight"] = head
    save_file(w, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


TEST_SH = """#!/bin/bash
set -u
mkdir -p /logs/verifier
rm -f /logs/verifier/reward.json
if [ -f /app/ok ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


def reward_tasks(out_dir: Path, n: int = 2) -> Path:
    """`n` copies of a task whose verifier gives 1 when /app/ok exists."""
    out_dir = Path(out_dir)
    for i in range(n):
        d = out_dir / f"make-ok-{i}"
        if d.exists():
            continue
        shutil.copytree(builtin_dataset_path() / "answer-42", d)
        (d / "instruction.md").write_text(f"Create the file /app/ok (task {i}).\n")
        (d / "tests" / "test.sh").write_text(TEST_SH)
        (d / "solution" / "solve.sh").write_text("#!/bin/bash\ntouch /app/ok\n")
    return out_dir


def run_config(output_dir: Path, model: Path, dataset: Path, run_id: str, steps: int = 3, evals: int = 0) -> dict:
    """A small deterministic training run on the fence policy: 2 prompts x 4 trials per step, 2 turns; `evals`
    trials per prompt in each evaluation (0: none)."""
    return {
        "run_id": run_id,
        "output_dir": str(output_dir),
        "model": {"source": str(model)},
        # the gate's own trials would meet the faults these runs inject; the tasks are proven by reward_tasks' use
        "dataset": {"path": str(dataset), "validate": False},
        "prompts": {"eval_fraction": 0.0},
        "engine": {"deterministic": True},
        "rollout": {
            "prompts_per_step": 2,
            "n_samples_per_prompt": 4,
            "concurrency": 4,
            "sampling": {"max_new_tokens": 16, "temperature": 1.0},
            "episode": {"max_turns": 2},
            "sandbox": {"create_limit": None},
        },
        "train": {
            "steps": steps,
            "optimizer": {"learning_rate": 2e-3},
            "checkpoint": {"interval": 2},
            "eval": {"samples_per_prompt": evals},
        },
    }
