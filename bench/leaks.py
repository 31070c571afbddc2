"""Sibling leaks in the built-in task families over many seeds, with and without the generator's leak check.

    .venv/bin/python bench/leaks.py [--seeds 100]

A leak: one instance's oracle, run in another instance's sandbox, passes that instance's verifier (by the
families' Python model, `grpoflow.prepare.families.solves`, which a test holds to the real sandbox), for two
instances of one category (one family, or near-sibling families). Printed per seed range: how many seeds drew a
leaking pair and how many pairs, by the pair's families, first as the generator drew before it checked (keys
alone), then as it draws now; and what the check costs prepare (milliseconds per seed).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from itertools import permutations
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpoflow.prepare.families as families  # noqa: E402


def leaking_pairs(seed: int) -> list[tuple[str, str]]:
    """(a, b) of one category where `a`'s oracle passes `b`'s verifier."""
    drawn = families.instances(seed)
    return [
        (a, b)
        for a, b in permutations(drawn, 2)
        if drawn[a][0].category == drawn[b][0].category and families.solves(drawn[a], drawn[b])
    ]


def survey(seeds: range) -> tuple[int, Counter[tuple[str, str]], float]:
    """(seeds with a leak, leaking pairs by (family of a, family of b), seconds to draw every seed's instances)."""
    t0 = time.perf_counter()
    for seed in seeds:
        families.instances(seed)
    seconds = time.perf_counter() - t0
    with_leak, kinds = 0, Counter()
    for seed in seeds:
        pairs = leaking_pairs(seed)
        with_leak += bool(pairs)
        kinds.update((a.rsplit("-", 1)[0], b.rsplit("-", 1)[0]) for a, b in pairs)
    return with_leak, kinds, seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=100)
    args = p.parse_args()
    seeds = range(args.seeds)
    with mock.patch.object(families, "leaks", lambda a, b: False):  # the draws of generator version 4
        before = survey(seeds)
    after = survey(seeds)
    print(f"seeds 0-{args.seeds - 1}, {len(families.FAMILIES)} families of {families.INSTANCES} instances")
    print("| generator | seeds with a leak | leaking pairs | ms per seed (draw) |")
    print("|---|---|---|---|")
    for name, (with_leak, kinds, seconds) in (("keys only", before), ("keys + leak check", after)):
        print(f"| {name} | {with_leak} | {sum(kinds.values())} | {1000 * seconds / args.seeds:.1f} |")
    for (a, b), n in before[1].most_common():
        print(f"  before: {a} oracle solves {b}: {n} pairs")


if __name__ == "__main__":
    main()
