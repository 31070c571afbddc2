"""No index-less GPU reaches torch: a trainer asked for `cuda` (the flow's rank 0, a Ray actor) computes on a named
GPU, so FSDP's `torch.cuda.set_device` and NCCL get one. No GPU runs here: torch's CUDA calls are faked at that
one boundary, and `set_device` checks its argument with torch's own index rule before the walk stops."""

import pytest
import torch
from torch.cuda._utils import _get_device_index

from grpoflow.config import TrainConfig
from grpoflow.train.fsdp import shard_trainer
from grpoflow.train.parallel import DataParallel
from grpoflow.train.trainer import load_trainer, trainer_device


class _Reached(Exception):
    """The walk got to the first CUDA call with a device torch accepts."""


@pytest.fixture
def fake_cuda(monkeypatch):
    """A machine whose process is on GPU 2 (what `torch.cuda.current_device` says), as torch would report it."""
    set_to: list[int] = []

    def set_device(device):
        set_to.append(_get_device_index(device))  # raises for `cuda` without an index, as the real one does
        raise _Reached

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    return set_to


@pytest.mark.parametrize(
    ("asked", "device"), [(None, "cuda:2"), ("cuda", "cuda:2"), ("cuda:5", "cuda:5"), ("cpu", "cpu")]
)
def test_a_trainer_device_always_names_its_gpu(fake_cuda, asked, device):
    assert trainer_device(asked) == torch.device(device)


def test_without_a_gpu_the_trainer_is_on_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert trainer_device() == torch.device("cpu")


@pytest.mark.parametrize("asked", [None, "cuda"])
def test_a_sharded_trainer_asked_for_cuda_sets_a_named_device(fake_cuda, tiny_model_dir, asked):
    # sharded: the weights stay in CPU memory until shard_trainer, whose first CUDA call is set_device
    state = load_trainer(tiny_model_dir, TrainConfig(), seed=0, device=asked, sharded=True)
    assert state.device == torch.device("cuda", 2)
    state.dp = DataParallel(group=None, rank=0, world=1, device=state.device)
    with pytest.raises(_Reached):
        shard_trainer(state, TrainConfig())
    assert fake_cuda == [2]
