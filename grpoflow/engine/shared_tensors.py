"""The wire format of SGLang's `/update_weights_from_tensor`: named tensors that stay where they are.

Each entry of `serialized_named_tensors` (one per tensor-parallel rank) is the base64 text of a
`multiprocessing` `ForkingPickler` dump of `[(name, tensor), ...]`, which is how SGLang's
`MultiprocessingSerializer` writes it. Torch's reductions pickle a tensor as a handle to its memory, not its
bytes: a CUDA IPC handle on a GPU, a shared-memory file name (`/dev/shm`) on the CPU. So only a colocated engine,
on the same host (the same GPU), can read them, and the request carries a few kilobytes whatever the model's size.

The reader takes only what torch's reductions write (`_ALLOWED`): a request is an HTTP body, and unpickling one
that could name any callable would run whatever it names. What is left to a caller (allocating tensors, mapping a
`/dev/shm` object it names) is the trust `/update_weights_from_disk` already asks for: the route is for a trainer
on the same host, and the embedded engine listens on 127.0.0.1 only. On a GPU, a CUDA IPC handle names its device
by index: the trainer and SGLang must number the GPUs alike (the same `CUDA_VISIBLE_DEVICES`).
"""

from __future__ import annotations

import base64
import io
import os
import pickle
import threading
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing

_REDUCTIONS = "torch.multiprocessing.reductions"
_ALLOWED = {
    _REDUCTIONS: {
        "rebuild_tensor",
        "rebuild_typed_storage",
        "rebuild_typed_storage_child",
        "rebuild_storage_filename",
        "rebuild_storage_empty",
        "rebuild_cuda_tensor",
        "rebuild_nested_tensor",
    },
    "torch": {"Tensor", "Size"},
    "torch.storage": {"UntypedStorage", "TypedStorage"},
    "torch.nn.parameter": {"Parameter"},
}
_DTYPES = {name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}
_strategy_lock = threading.Lock()


@contextmanager
def shared_by_file_name():
    """Torch shares CPU memory by file descriptor unless told otherwise, and a descriptor can only be passed to a
    process this one started. The engine is another process, so for the block CPU memory is shared by file name;
    the process-wide setting is restored after it."""
    with _strategy_lock:
        before = torch.multiprocessing.get_sharing_strategy()
        torch.multiprocessing.set_sharing_strategy("file_system")
        try:
            yield
        finally:
            torch.multiprocessing.set_sharing_strategy(before)


def shared_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat tensor another process on this host can map: shared memory on the CPU; a GPU tensor as it is (CUDA
    IPC shares any)."""
    if torch.device(device).type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    # Touching a page past a full /dev/shm kills the process (SIGBUS) instead of raising: check first.
    shm = os.statvfs("/dev/shm")
    free, need = shm.f_bavail * shm.f_frsize, numel * torch.empty((), dtype=dtype).element_size()
    if need > free:
        raise MemoryError(
            f"/dev/shm has {free / 2**20:.0f} MiB free and the weights need {need / 2**20:.0f} MiB: enlarge it "
            "(docker: --shm-size) or use another `engine.weight_sync.mode`"
        )
    flat = torch.empty(numel, dtype=dtype)
    with shared_by_file_name():
        flat.share_memory_()
    return flat


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """`named` as one entry of `serialized_named_tensors`. CPU tensors must live in shared memory
    (`shared_buffer`): the engine maps them, so they must stay unchanged until it answered."""
    buf = io.BytesIO()
    with shared_by_file_name():
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(named)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class _TorchOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()) or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a tensor handle")


def deserialize_named_tensors(text: str) -> list[tuple[str, torch.Tensor]]:
    """The tensors one entry of `serialized_named_tensors` names, mapped (not copied) into this process. Raises
    ValueError for anything but a list of (name, tensor) pairs written by `serialize_named_tensors`."""
    try:
        data = base64.b64decode(text, validate=True)
        named = _TorchOnly(io.BytesIO(data)).load()
    except (ValueError, pickle.UnpicklingError, EOFError, OSError, RuntimeError) as e:
        raise ValueError(f"not a list of shared tensors: {e}") from e
    if not isinstance(named, list) or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor) for p in named
    ):
        raise ValueError("not a list of (name, tensor) pairs")
    return named
