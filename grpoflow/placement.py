"""Which GPUs of this machine the run's processes use: the plan, made before anything starts, from the config and
the machine's GPU count alone (so it is tested without GPUs), refused with one line when it cannot work, and
written into run.json.

The trainer's ranks take GPUs 0..R-1 (rank r on GPU r, `GpuPlan.rank_device`); an engine the run launches
on GPUs (`engine.backend` sglang-launch or vllm-launch, `engine.launch.device` cuda) takes the next `engine.tp_size`,
from GPU R (SGLang's `--base-gpu-id`; vLLM sees only those through `CUDA_VISIBLE_DEVICES`). Overlap is refused
rather than shared: an engine's KV pool sized on a GPU that already holds the trainer runs the first update out
of memory, and a `distributed` weight sync would put two NCCL ranks (trainer rank 0 and an engine rank) on one
device, which NCCL refuses. With `cluster.ray_address` only rank 0 trains here
(the others are Ray actors on Ray's GPUs); the embedded CPU engine and an attached engine (`engine.url`, GPUs of
its own) take none of this machine's GPUs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from grpoflow.config import LaunchedEngine, RunConfig
from grpoflow.errors import ConfigError


@dataclass(frozen=True)
class GpuPlan:
    gpus: int  # GPUs this machine has
    trainer: tuple[int, ...]  # the GPU of each trainer rank on this machine; empty: the CPU (or Ray's GPUs)
    engine: tuple[int, ...]  # the GPUs a launched engine runs on; empty: none of this machine's

    @property
    def engine_base_gpu(self) -> int | None:
        """The first GPU of a launched engine (SGLang's `--base-gpu-id`); None when it takes no GPU here."""
        return self.engine[0] if self.engine else None

    def rank_device(self, rank: int) -> str:
        """The torch device of trainer rank `rank` started on this machine: its GPU, or the CPU (gloo)."""
        return f"cuda:{self.trainer[rank]}" if self.trainer else "cpu"

    def to_json(self) -> dict[str, object]:
        return {"gpus": self.gpus, "trainer": list(self.trainer), "engine": list(self.engine)}

    def describe(self) -> str:
        """One line: where each part runs, e.g. `trainer ranks on GPUs 0-3, engine on GPUs 4-7 (of 8)`."""
        if not self.gpus:
            return "no GPU on this machine: the trainer and any launched engine run on the CPU"
        trainer = (
            f"trainer on GPU {_span(self.trainer)}"
            if len(self.trainer) == 1
            else f"trainer ranks on GPUs {_span(self.trainer)}"
        )
        engine = f"engine on GPUs {_span(self.engine)}" if self.engine else "engine off this machine's GPUs"
        return f"{trainer}, {engine} (of {self.gpus})"


def plan_gpus(cfg: RunConfig, gpus: int) -> GpuPlan:
    """The run's GPU plan on a machine with `gpus` GPUs; `ConfigError` (one line naming the fields) when the
    trainer and a launched engine cannot each have GPUs of their own."""
    ranks = cfg.cluster.train_ranks
    launched = isinstance(cfg.engine, LaunchedEngine) and cfg.engine.launch.device == "cuda"
    if gpus == 0:
        if launched:
            raise ConfigError(
                f"engine.backend={cfg.engine.backend} with engine.launch.device=cuda: this machine has no GPU "
                "(engine.launch.device=cpu runs it on the CPU)"
            )
        return GpuPlan(0, (), ())
    # With a Ray cluster, rank 0 trains in the flow's process (here) and the others are Ray actors on Ray's GPUs.
    on_ray = bool(cfg.cluster.ray_address) and ranks > 1
    trainer = (0,) if on_ray else tuple(range(ranks))
    if len(trainer) > gpus:
        raise ConfigError(f"cluster.train_ranks={ranks}: one GPU per rank, this machine has {gpus}")
    if not launched:
        return GpuPlan(gpus, trainer, ())
    tp = cfg.engine.tp_size
    if len(trainer) + tp > gpus:
        raise ConfigError(
            f"engine.tp_size={tp} beside cluster.train_ranks={ranks} needs {len(trainer) + tp} GPUs, this machine "
            f"has {gpus}: the engine's KV pool would sit on the trainer's GPUs (the first update runs out of memory) "
            "and a distributed sync would put two NCCL ranks on one GPU"
        )
    return GpuPlan(gpus, trainer, tuple(range(len(trainer), len(trainer) + tp)))


def visible_devices(gpus: Iterable[int], environ: Mapping[str, str] = os.environ) -> str:
    """`CUDA_VISIBLE_DEVICES` for a child that must see the plan's `gpus`. The plan numbers the GPUs this process
    sees, so under a mask of the parent's own (`4,5,6,7`, or GPU UUIDs) plan GPU i is the mask's i-th entry."""
    mask = environ.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in mask.split(",")] if mask else None
    return ",".join(entries[g] if entries is not None else str(g) for g in gpus)


def machine_gpus() -> int:
    """The CUDA GPUs this process sees (torch's count, so `CUDA_VISIBLE_DEVICES` applies)."""
    import torch  # only when asked: the base layer must not load torch on import

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _span(ids: tuple[int, ...]) -> str:
    return str(ids[0]) if len(ids) == 1 else f"{ids[0]}-{ids[-1]}"
