"""Runs inside vLLM's workers (Python 3.11, vLLM's torch), not in grpoflow: the in-memory weight sync over gloo.

vLLM's own weight-transfer routes have GPU transports only, so a launched vLLM is given this class as its
`--worker-extension-cls` (`grpoflow.engine.vllm_launch`, with grpoflow's source dir on its PYTHONPATH): its
methods become methods of every worker, called through `POST /collective_rpc` {"method", "kwargs"} with string
arguments (`grpoflow.engine.vllm_client.VllmClient`). The worker joins the trainer's weight-update group as SGLang's workers do
(`grpoflow.engine.update_group`, the same code on both ends), then each sync receives the announced tensors and
loads them in place with `model_runner.reload_weights(weights_iterator=...)`. Imports nothing but torch and
`update_group`, which run on vLLM's interpreter.
"""

from __future__ import annotations

import json

from grpoflow.engine.update_group import UPDATE_GROUP_TIMEOUT_S, join_update_group, receive_tensors

EXTENSION = f"{__name__}.WeightUpdateExtension"


class WeightUpdateExtension:
    """Mixed into vLLM's worker class: `self.rank` (its tensor-parallel rank) and `self.model_runner` are the
    worker's."""

    def grpoflow_join_update_group(
        self, master_address: str, master_port: str, rank_offset: str, world_size: str, group_name: str, backend: str
    ) -> None:
        rank = int(rank_offset) + int(getattr(self, "rank", 0))
        self._grpoflow_group = join_update_group(
            master_address, int(master_port), rank, int(world_size), group_name, backend, UPDATE_GROUP_TIMEOUT_S
        )

    def grpoflow_receive_weights(self, names: str, dtypes: str, shapes: str) -> int:
        """Receive the tensors rank 0 broadcasts (`names`, `dtypes`, `shapes`: JSON lists, in broadcast order) and
        serve them; returns how many."""
        tensors = receive_tensors(self._grpoflow_group, json.loads(names), json.loads(dtypes), json.loads(shapes))
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
        return len(tensors)
