"""The `/update_weights_from_tensor` wire format: tensors travel as handles to shared memory, and the reader takes
nothing but tensor handles."""

from __future__ import annotations

import base64
import os
import pickle
from collections import namedtuple

import pytest
import torch

from grpoflow.engine import shared_tensors
from grpoflow.engine.shared_tensors import deserialize_named_tensors, serialize_named_tensors, shared_buffer


def test_a_round_trip_names_views_of_one_shared_buffer_not_copies():
    flat = shared_buffer(30, torch.float32, torch.device("cpu"))
    flat.copy_(torch.arange(30.0))
    text = serialize_named_tensors([("a", flat[:6].view(2, 3)), ("b", flat[6:30])])
    assert len(text) < 4096  # handles, not the 120 bytes' worth of values times anything
    got = dict(deserialize_named_tensors(text))
    assert got["a"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] and got["b"][-1].item() == 29.0
    flat[0] = -1.0  # the same memory: what is read afterwards is what the buffer holds now
    assert got["a"][0, 0].item() == -1.0
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"  # restored


@pytest.mark.parametrize(
    "text, match",
    [
        ("not base64!", "not a list of shared tensors"),
        (base64.b64encode(pickle.dumps({"w": 1})).decode(), r"not a list of \(name, tensor\) pairs"),
        (base64.b64encode(pickle.dumps([("w", os.getcwd)])).decode(), "getcwd is not part of a tensor handle"),
    ],
)
def test_anything_but_a_list_of_named_tensor_handles_is_refused(text, match):
    with pytest.raises(ValueError, match=match):
        deserialize_named_tensors(text)


def test_a_buffer_larger_than_dev_shm_is_refused_before_it_is_touched(monkeypatch):
    Stat = namedtuple("Stat", "f_bavail f_frsize")
    monkeypatch.setattr(shared_tensors.os, "statvfs", lambda path: Stat(f_bavail=10, f_frsize=4096))
    with pytest.raises(MemoryError, match=r"/dev/shm has 0 MiB free and the weights need 4 MiB"):
        shared_buffer(2**20, torch.float32, torch.device("cpu"))
