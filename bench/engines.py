"""The engines side by side on this CPU: the embedded engine, real SGLang 0.5.23 (torch-native paths) and real
vLLM 0.32 (its CPU build), one at a time on the same model, through the same HTTP client a run uses.

    .venv/bin/python bench/engines.py [--model smollm2-135m-instruct] [--new-tokens 64] [--requests 2]
        [--syncs 3] [--engines embedded sglang-cpu vllm-cpu]

Per engine: install (SGLang's and vLLM's environments: `tests/engines/install_sglang.sh`, `install_vllm.sh`, their
recorded seconds and size on disk; installed first if missing), start (spawn until `/health` answers), memory (resident set of the server's
process tree once it served the runs), tokens/s of 1 and of 8 concurrent sessions (each session sends
`--requests` generations of `--new-tokens` sampled tokens, EOS ignored, a prompt of its own), and the seconds of
one weight sync (`disk`: the step's bf16/fp32 weights written beforehand, then `/update_weights_from_disk`;
`distributed`: the broadcast over gloo, SGLang's session calls included), median of `--syncs`, each followed by the
weight version read back (vLLM takes `disk` only here: `-`). Beside them: HF `generate` tokens/s on one thread (this machine's speed today). The
embedded engine runs on one torch thread (its default); SGLang takes the threads it chooses.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.main_job import hf_generate_tok_s  # noqa: E402
from grpoflow.config import EmbeddedEngine, Engine, SglangLaunch, TrainConfig, VllmLaunch, parse_run_config  # noqa: E402
from grpoflow.engine import sglang_launch, vllm_launch  # noqa: E402
from grpoflow.engine.launch import start_embedded_engine  # noqa: E402
from grpoflow.engine.protocol import SamplingParams  # noqa: E402
from grpoflow.prepare.model import prepare_model  # noqa: E402
from grpoflow.train.checkpoint import save_checkpoint  # noqa: E402
from grpoflow.train.sync import open_weight_sync, sync_dtype  # noqa: E402
from grpoflow.train.trainer import load_trainer  # noqa: E402
from tests.fakes.proc import descendants  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
INSTALLERS = {"sglang-cpu": ["install_sglang.sh", sys.executable], "vllm-cpu": ["install_vllm.sh"]}


def install(name: str) -> tuple[str, float | None, int]:
    """(The engine's python, install seconds as recorded by its installer, bytes of its venv on disk)."""
    script, *args = INSTALLERS[name]
    out = subprocess.run(
        ["bash", str(ROOT / "tests" / "engines" / script), *args], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise SystemExit(f"bench/engines.py: {name} did not install:\n{out.stderr[-2000:]}")
    python = out.stdout.strip().splitlines()[-1]
    venv = Path(python).parents[1]
    seconds = venv / ".grpoflow-install-seconds"
    size = int(subprocess.run(["du", "-sb", str(venv)], capture_output=True, text=True).stdout.split()[0])
    return python, float(seconds.read_text()) if seconds.is_file() else None, size


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and every process below it."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:  # it ended while we looked
            continue
    return total


def sessions_tok_s(client, sessions: int, args) -> float:
    """Generated tokens per second over `sessions` threads, each sending `args.requests` requests in turn."""
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)
    counts = [0] * sessions
    errors: list[BaseException] = []

    def session(i: int) -> None:
        gen = torch.Generator().manual_seed(i)
        try:
            for _ in range(args.requests):
                prompt = torch.randint(100, 40000, (args.prompt_tokens,), generator=gen).tolist()
                counts[i] += len(client.generate(prompt, params, return_logprob=True).output_ids)
        except BaseException as e:  # noqa: BLE001  (raised below, in the main thread)
            errors.append(e)

    threads = [threading.Thread(target=session, args=(i,)) for i in range(sessions)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sum(counts) / (time.perf_counter() - t0)


def sync_seconds(trainer, engine_cfg: Engine, url: str, mode: str, work: Path, syncs: int) -> float:
    """Median seconds of one sync (`disk`: the weights are written first, in the engine's dtype, outside the
    timing)."""
    cfg = parse_run_config({"engine": engine_cfg.model_dump() | {"weight_sync": {"mode": mode}}})
    seconds = []
    with open_weight_sync(cfg, url, trainer) as sync:
        for i in range(syncs):
            ckpt = None
            if sync.needs_dir:
                ckpt = save_checkpoint(
                    trainer.model, None, work / f"{mode}-{i}", durable=False, dtype=sync_dtype(cfg.engine)
                )
            t0 = time.perf_counter()
            sync.push(trainer, f"{mode}-{i}", ckpt)  # the version is read back in there
            seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def run_engine(name: str, model_dir: str, trainer, args, work: Path) -> dict:
    row: dict = {"engine": name}
    log = work / f"{name}.log"
    t0 = time.perf_counter()
    if name == "embedded":
        cfg = EmbeddedEngine()
        server = start_embedded_engine(model_dir, seed=0, log_path=log)
    elif name == "sglang-cpu":
        python, row["install_s"], row["install_bytes"] = install(name)
        cfg = SglangLaunch.model_validate(
            {"backend": "sglang-launch", "sglang": {"python": python}, "launch": {"device": "cpu"}}
        )
        extra, env = sglang_launch.launch_settings(cfg, seed=0)
        t0 = time.perf_counter()
        server = sglang_launch.start_sglang_server(
            python, model_dir, extra_args=extra, env=env, log_path=log, startup_timeout=600
        )
    else:
        python, row["install_s"], row["install_bytes"] = install(name)
        cfg = VllmLaunch.model_validate(
            {
                "backend": "vllm-launch",
                "vllm": {"python": python, "args": ["--max-model-len", "2048"]},
                "launch": {"device": "cpu"},
            }
        )
        extra, env = vllm_launch.launch_settings(cfg, seed=0)
        t0 = time.perf_counter()
        server = vllm_launch.start_vllm_server(
            python, model_dir, extra_args=extra, env=env, log_path=log, startup_timeout=600
        )
    with server:
        row["start_s"] = time.perf_counter() - t0
        client = server.client
        client.generate([1, 2, 3], SamplingParams(max_new_tokens=4))  # warm-up
        row["tok_s_1"] = sessions_tok_s(client, 1, args)
        row["tok_s_8"] = sessions_tok_s(client, 8, args)
        row["rss_bytes"] = tree_rss(server.pid)
        for mode in ("disk", "distributed") if cfg.api == "sglang" else ("disk",):
            row[f"sync_{mode}_s"] = sync_seconds(trainer, cfg, server.url, mode, work, args.syncs)
    return row


ENGINES = ["embedded", "sglang-cpu", "vllm-cpu"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="A model source as `model.source` takes it.")
    p.add_argument("--engines", nargs="+", default=[*ENGINES], choices=ENGINES)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=2, help="Generations per session.")
    p.add_argument("--syncs", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model_dir = str(prepare_model(args.model).path)
    base = hf_generate_tok_s(model_dir, args.new_tokens)
    trainer = load_trainer(model_dir, TrainConfig(), seed=0)
    print(f"model {args.model}; HF generate (fp32, 1 thread): {base:.1f} tok/s", flush=True)
    print(
        f"{'engine':<12}{'install':>16}{'start':>8}{'memory':>9}{'1 session':>11}{'8 sessions':>12}"
        f"{'sync disk':>11}{'sync dist.':>11}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="grpoflow-bench-engines-") as tmp:
        for name in args.engines:  # each row as soon as it is measured
            r = run_engine(name, model_dir, trainer, args, Path(tmp))
            install = (
                "-"
                if "install_bytes" not in r
                else f"{r.get('install_s') or 0:.0f}s {r['install_bytes'] / 2**20:.0f}MB"
            )
            print(
                f"{r['engine']:<12}{install:>16}{r['start_s']:>7.1f}s{r['rss_bytes'] / 2**30:>7.2f}GB"
                f"{r['tok_s_1']:>7.1f}tok/s{r['tok_s_8']:>8.1f}tok/s"
                f"{r['sync_disk_s']:>10.2f}s"
                + (f"{r['sync_distributed_s']:>10.2f}s" if "sync_distributed_s" in r else f"{'-':>11}"),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
