"""Does this CPU's arithmetic give the same update whatever the thread count and the process's history? One AdamW
step of a SmolLM2-shaped model (random weights, the main job's 135M shapes, so MKL sees the same GEMMs) on fixed
random tokens, in fresh processes: on 1 thread, on 2, switched from 1 to 2 halfway through the backward, and
after other work shifted the allocator — each with MKL's reproducible mode off and with grpoflow's
`MKL_CBWR=AUTO,STRICT`. Needs only torch and transformers (it runs where grpoflow's other dependencies are not
installed, e.g. on an accelerator machine's CPU).

    python bench/cpu_bits.py            # prints the CPU, then one row per setting: seconds and the weights' hash
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time

# SmolLM2-135M's shapes (config.json of HuggingFaceTB/SmolLM2-135M-Instruct)
SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
CHILD = "child"


def update(mode: str) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).float()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, SHAPE["vocab_size"], (8, 160), generator=torch.Generator().manual_seed(1))  # (B, T)
    if mode == "shifted":  # other work first: the allocator's state and the buffers' alignment differ
        junk = [torch.randn(n, 77) for n in (13, 4099, 257)]
        (junk[1] @ junk[1].T).sum()
    threads = {"1": 1, "2": 2, "switch": 1, "shifted": 2}[mode]
    torch.set_num_threads(threads)
    if mode == "switch":  # two threads from the middle layer's backward on
        layer = model.model.layers[len(model.model.layers) // 2]
        layer.register_full_backward_pre_hook(lambda module, grad: torch.set_num_threads(2))
    t = time.perf_counter()
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    seconds = time.perf_counter() - t
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return {"seconds": seconds, "weights": digest.hexdigest()[:16], "loss": loss.item()}


def cpu() -> str:
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model} ({' '.join(isa)}), {os.cpu_count()} cpus"


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == CHILD:
        print(json.dumps(update(sys.argv[2])))
        return
    import torch

    print(f"CPU: {cpu()}; torch {torch.__version__}")
    rows = []
    for cbwr in ("OFF", "AUTO,STRICT"):
        for mode in ("1", "2", "switch", "shifted"):
            env = dict(os.environ, MKL_CBWR=cbwr)
            out = subprocess.run([sys.executable, __file__, CHILD, mode], env=env, capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr[-2000:])
                raise SystemExit(f"{cbwr} {mode}: failed")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append((cbwr, mode, r))
            print(f"MKL_CBWR={cbwr:12s} threads {mode:8s} {r['seconds']:6.2f}s  weights {r['weights']}")
    for cbwr in ("OFF", "AUTO,STRICT"):
        hashes = {r["weights"] for c, _, r in rows if c == cbwr}
        print(
            f"MKL_CBWR={cbwr}: {'the same bits in every setting' if len(hashes) == 1 else f'{len(hashes)} different results'}"
        )


if __name__ == "__main__":
    main()
