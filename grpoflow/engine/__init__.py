"""Inference engine access through SGLang's HTTP API: the client (works against real SGLang) and an embedded
CPU engine that speaks the same API (`scheduler` → `server`, started by `launch`).

Importing this package does not import torch; `scheduler`, `server` and `weights` do.
"""

from grpoflow.engine.client import EngineClient
from grpoflow.engine.launch import EngineProcess, start_embedded_engine

__all__ = ["EngineProcess", "EngineClient", "start_embedded_engine"]
