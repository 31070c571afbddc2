"""A stage's numbers, split by kind where they are made.

`computed` is what the run computed (rewards, losses, token counts): a rerun on the deterministic path reproduces
it, so it goes to metrics.jsonl. `seconds` is wall-clock (durations, and rates per second): it differs between
identical runs, so it goes to timings.jsonl. A stage says which is which; nothing downstream guesses it from a
key's spelling.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Figures:
    computed: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def prefixed(self, prefix: str) -> Figures:
        """The same figures with every key under `prefix` (`"rollout/"`)."""
        return Figures(
            {f"{prefix}{k}": v for k, v in self.computed.items()},
            {f"{prefix}{k}": v for k, v in self.seconds.items()},
        )
