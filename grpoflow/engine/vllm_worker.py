"""Runs inside vLLM's workers (Python 3.11, vLLM's torch), not in grpoflow: the in-memory weight sync.

vLLM's own weight-transfer routes have GPU transports only, so a launched vLLM is given this class as its
`--worker-extension-cls` (`grpoflow.engine.vllm_launch`, with grpoflow's source dir on its PYTHONPATH): its
methods become methods of every worker, called through `POST /collective_rpc` {"method", "kwargs"} with string
arguments (`grpoflow.engine.vllm_client.VllmClient`). The worker joins the trainer's weight-update group as SGLang's workers do
(`grpoflow.engine.update_group`, the same code on both ends). A sync is a session, as SGLang's: it opens vLLM's
in-place reload (`initialize_layerwise_reload`: each layer buffers what it receives until it is whole, then
loads it), receives the sync's buckets one request each, on the worker's device, each loaded before the next is
received, and closes the reload (`finalize_layerwise_reload`, then the caches the old weights made are dropped, as
`model_runner.reload_weights` does). So the worker never holds more than one bucket and the layers it completes.
Imports nothing but torch, vLLM and `update_group`, which run on vLLM's interpreter.
"""

from __future__ import annotations

import json

import torch

from grpoflow.engine.update_group import UPDATE_GROUP_TIMEOUT_S, join_update_group, receive_tensors

EXTENSION = f"{__name__}.WeightUpdateExtension"


class WeightUpdateExtension:
    """Mixed into vLLM's worker class: `self.rank` (its tensor-parallel rank), `self.device` and
    `self.model_runner` are the worker's."""

    def grpoflow_rank(self) -> int:
        """Its rank in vLLM's world (one answer per worker: the caller counts them)."""
        return int(getattr(self, "rank", 0))

    def grpoflow_join_update_group(
        self, master_address: str, master_port: str, rank_offset: str, world_size: str, group_name: str, backend: str
    ) -> None:
        rank = int(rank_offset) + int(getattr(self, "rank", 0))
        self._grpoflow_group = join_update_group(
            master_address, int(master_port), rank, int(world_size), group_name, backend, UPDATE_GROUP_TIMEOUT_S
        )
        # NCCL receives into the worker's accelerator; gloo into host memory
        self._grpoflow_device = self.device if backend == "nccl" else torch.device("cpu")

    def grpoflow_begin_weights(self) -> None:
        """Open an in-place reload of the served model for the sync's buckets."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())

    def grpoflow_receive_weights(self, names: str, dtypes: str, shapes: str) -> int:
        """Receive one bucket rank 0 broadcasts (`names`, `dtypes`, `shapes`: JSON lists, in broadcast order) and
        load it into the open reload; returns how many tensors."""
        tensors = receive_tensors(
            self._grpoflow_group, json.loads(names), json.loads(dtypes), json.loads(shapes), self._grpoflow_device
        )
        self.model_runner.get_model().load_weights(iter(tensors.items()))
        return len(tensors)

    def grpoflow_end_weights(self) -> None:
        """Close the reload: every layer serves what it received; the caches the old weights made are dropped."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        runner = self.model_runner
        finalize_layerwise_reload(runner.get_model(), runner.vllm_config.model_config)
        runner.reset_lora_state()
        runner.reset_encoder_cache()
        runner.reset_mm_cache()
