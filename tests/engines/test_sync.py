"""Weight syncs into real SGLang on the CPU, as a run makes them: the start-of-run logprob probe, then each sync
mode through `open_weight_sync`, the served-weights probe after every push and the weight version read back.

`distributed` over gloo needs SGLang's weight-update session (`/begin_weight_update` ... `/end_weight_update`);
without it SGLang refuses the update with 400, which is how this test failed before grpoflow opened one.
"""

from __future__ import annotations

import pytest

from grpoflow.config import TrainConfig, parse_run_config
from grpoflow.train.probe import check_logprob_agreement
from grpoflow.train.trainer import load_trainer
from tests.engines.conftest import BUCKET_MB, sync_twice_and_probe

pytestmark = pytest.mark.sglang


def _cfg(sglang, mode: str):
    return parse_run_config(
        {"engine": {"backend": "sglang", "url": sglang.url, "weight_sync": {"mode": mode, "bucket_mb": BUCKET_MB}}}
    )


def test_engine_and_trainer_score_a_probe_reply_alike(sglang):
    trainer = load_trainer(sglang.model_dir, TrainConfig(), seed=0)
    gap = check_logprob_agreement(sglang.client, trainer, _cfg(sglang, "disk"))
    assert gap["tokens"] > 0 and gap["mean"] < 0.1


@pytest.mark.parametrize("mode", ["disk", "distributed", "tensor"])
def test_each_sync_serves_the_trainers_weights_and_reports_its_version(sglang, mode, tmp_path, restore_base):
    sync_twice_and_probe(sglang, _cfg(sglang, mode), tmp_path)
