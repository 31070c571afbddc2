"""Throughput of the embedded engine's scheduler: batched vs sequential, 1 and 8 concurrent sessions.

    python bench/engine.py [--model-path DIR] [--sessions 1 8] [--new-tokens 64] [--threads N] [--no-pack]
    python bench/engine.py --random-smollm2 /tmp/smollm2-random   # SmolLM2-135M's shape, random weights

A session is a client thread sending `--requests` generations one after another (random prompt of
`--prompt-tokens` tokens, `--new-tokens` sampled tokens, EOS ignored so every request has the same length).
Every request has its own random prompt (no prefix-cache reuse). "batched" lets up to `sessions` requests
share decode steps; "sequential" serves one request at a time
(max_batch_size=1), which is what an engine without batching does. The scheduler is driven in-process (no
HTTP), so the figures are the engine's, not the web layer's. Without --model-path the tiny test model is built
in a temporary folder. Under each row: how many prefill forwards the batched runs' requests took (batched
prefill) and the share of wall time the scheduler was busy (`busy_time_s`, as /get_server_info reports it).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpoflow.embedded.engine.scheduler import Scheduler  # noqa: E402
from grpoflow.engine.protocol import SamplingParams  # noqa: E402
from tests.fakes.tiny_model import build_tiny_model  # noqa: E402

# HuggingFaceTB/SmolLM2-135M-Instruct's config.json, minus the weights.
SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    hidden_act="silu",
)


def build_random_smollm2(out_dir: Path) -> Path:
    """LlamaForCausalLM with SmolLM2-135M's shape and random weights, plus the tiny model's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (out_dir / "config.json").is_file():
        return out_dir
    with tempfile.TemporaryDirectory() as tmp:
        tok = AutoTokenizer.from_pretrained(build_tiny_model(Path(tmp) / "tiny"))
    torch.manual_seed(0)
    cfg = LlamaConfig(**SMOLLM2_135M, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def run(sched: Scheduler, sessions: int, batched: bool, args: argparse.Namespace, seed: int) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second of this process) for `sessions` concurrent clients.

    Adds the run's prefill forwards, requests and busy/wall seconds to `args.totals[batched]`."""
    sched.max_batch_size = sessions if batched else 1
    vocab = min(sched.vocab_size, len(sched.tokenizer))
    rng = torch.Generator().manual_seed(seed)
    # A fresh random prompt per request: no run profits from another's prefix cache entries.
    prompts = [
        [torch.randint(3, vocab, (args.prompt_tokens,), generator=rng).tolist() for _ in range(args.requests)]
        for _ in range(sessions)
    ]
    counts = [0] * sessions

    def session(i: int) -> None:
        for r in range(args.requests):
            p = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, sampling_seed=1000 * i + r)
            counts[i] += len(sched.generate(prompts[i][r], p).output_ids)

    threads = [threading.Thread(target=session, args=(i,)) for i in range(sessions)]
    before = dict(sched.internal_state())
    t0, c0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    after = sched.internal_state()
    totals = getattr(args, "totals", None)
    if totals is not None:
        for key in ("prefill_forwards", "prefills", "busy_time_s"):
            totals[batched][key] += after[key] - before[key]
        totals[batched]["wall_s"] += wall
    return sum(counts) / wall, sum(counts) / cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", type=Path, default=None, help="HF model folder (default: the tiny test model).")
    ap.add_argument("--random-smollm2", type=Path, default=None, help="Build (once) and bench SmolLM2-135M's shape.")
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=2, help="Requests per session.")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default: 1, the server's default).")
    ap.add_argument("--no-pack", action="store_true", help="Plain F.linear (MKL) instead of oneDNN-packed linears.")
    ap.add_argument("--repeats", type=int, default=2, help="Runs per figure; the best is shown (shared machines).")
    args = ap.parse_args()

    tmp = None
    if args.random_smollm2 is not None:
        model_path = build_random_smollm2(args.random_smollm2)
    elif args.model_path is not None:
        model_path = args.model_path
    else:
        tmp = tempfile.TemporaryDirectory()
        model_path = build_tiny_model(Path(tmp.name) / "tiny")

    sched = Scheduler(
        model_path, threads=args.threads, max_batch_size=max(args.sessions), pack_weights=not args.no_pack
    )
    params = sum(p.numel() for p in sched.model.parameters())
    print(
        f"model {model_path} ({params / 1e6:.1f}M params), torch threads {torch.get_num_threads()}, "
        f"{sched.packed_linears} packed linears, "
        f"{args.requests} requests/session x {args.new_tokens} new tokens, prompt {args.prompt_tokens} tokens"
    )
    run(sched, 1, True, argparse.Namespace(**{**vars(args), "requests": 1, "new_tokens": 8}), seed=-1)  # warm-up

    # Wall-clock throughput is what a client sees; tokens per CPU-second is steadier on a shared machine (with
    # one torch thread it counts the work done, not the time spent waiting for a core).
    print(f"best of {args.repeats} runs per figure")
    print(
        f"{'sessions':>8} {'batched tok/s':>14} {'sequential tok/s':>17} {'ratio':>6} | "
        f"{'batched tok/cpu-s':>18} {'sequential tok/cpu-s':>21} {'ratio':>6}"
    )
    seed = 0
    for s in args.sessions:
        keys = ("prefill_forwards", "prefills", "busy_time_s", "wall_s")
        args.totals = {b: dict.fromkeys(keys, 0.0) for b in (True, False)}
        best = {(b, k): 0.0 for b in (True, False) for k in (0, 1)}
        for _ in range(args.repeats):  # alternate the modes so both see the same machine load
            for batched in (True, False):
                seed += 1
                for k, value in enumerate(run(sched, s, batched, args, seed)):
                    best[batched, k] = max(best[batched, k], value)
        wall_b, wall_s, cpu_b, cpu_s = best[True, 0], best[False, 0], best[True, 1], best[False, 1]
        print(
            f"{s:>8} {wall_b:>14.1f} {wall_s:>17.1f} {wall_b / wall_s:>5.2f}x | "
            f"{cpu_b:>18.1f} {cpu_s:>21.1f} {cpu_b / cpu_s:>5.2f}x"
        )
        tb = args.totals[True]
        print(
            f"{'':>8} batched: {tb['prefills']:.0f} requests in {tb['prefill_forwards']:.0f} prefill forwards, "
            f"engine busy {tb['busy_time_s'] / tb['wall_s']:.0%} of wall time"
        )
    sched.close()
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
