"""One GRPO update of SmolLM2 (the main job's model, whose GEMMs are wide enough to be split between threads) on
fixed agentic samples, fingerprinted: the bits of the weights after it, and its loss and grad norm. Run in this
process or, as `python -m tests.fakes.update_fingerprint THREADS`, in a fresh one."""

from __future__ import annotations

import hashlib
import json
import sys


def update_fingerprint(threads: int) -> dict:
    import torch

    from grpoflow.config import TrainConfig
    from grpoflow.prepare.model import prepare_model
    from grpoflow.train.step import train_step
    from grpoflow.train.trainer import load_trainer
    from tests.fakes.samples import agentic_samples

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cfg = TrainConfig(optimizer={"learning_rate": 1e-4})  # the whole step in one micro-batch, as on the main job
        state = load_trainer(prepare_model("smollm2-135m-instruct").path, cfg, seed=3)
        m = train_step(state, agentic_samples(state.model, n_groups=2, per_group=4), cfg, seed=7)
    finally:
        torch.set_num_threads(before)
    digest = hashlib.sha256()
    for name, tensor in sorted(state.model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return {"weights": digest.hexdigest(), "loss": m["loss"], "grad_norm": m["grad_norm"]}


if __name__ == "__main__":
    print(json.dumps(update_fingerprint(int(sys.argv[1]))))
