"""A model dir's safetensors files, checked at prepare without reading the weights: each file's header parses and
its tensors cover the file exactly (what a truncated download or a cut copy breaks), and every shard a
`*.safetensors.index.json` names is there. A flipped byte inside the data cannot be seen this way; the weights'
sha256 in run.json pins what a run trained."""

from __future__ import annotations

import json
from pathlib import Path

from grpoflow.errors import one_line


def safetensors_problem(model_dir: Path) -> str | None:
    """The first problem of `model_dir`'s safetensors files as one line, or None."""
    from safetensors import SafetensorError, safe_open

    for index in sorted(model_dir.glob("*.safetensors.index.json")):
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            return f"{index.name} is not a safetensors index ({type(err).__name__}: {one_line(str(err))})"
        missing = sorted(s for s in shards if not (model_dir / s).is_file())
        if missing:
            return f"{index.name} names {', '.join(missing[:3])}, which the dir lacks"
    for f in sorted(model_dir.glob("*.safetensors")):
        try:
            # Parses the header and checks that the tensors' offsets cover the file exactly; maps, reads no data.
            with safe_open(f, framework="pt") as weights:
                weights.keys()
        except (SafetensorError, OSError) as err:
            return f"{f.name} is truncated or corrupt ({one_line(str(err))})"
    return None
