"""Costs of the token-exact session server: per-request overhead, tokenising, tree/segment work, mismatch rate.

    python bench/sessions.py [--model DIR] [--engine] [--sessions 8] [--turns 6] [--obs-chars 400]
        [--max-tokens 48] [--tree-turns 60] [--tree-tokens 30000] [--tree-branches 3]

1. Per-request latency of a multi-turn agent conversation (each session re-sends its whole history plus a new
   tool observation every turn), sent (a) straight to the backend's /v1/chat/completions and (b) through
   `SessionServer`'s /sessions/<id>/v1/chat/completions, which renders the template, tokenises, calls /generate
   and records the tree. Backend: the SGLang stand-in (tests/fakes/sglang_standin.py; a scripted model, so
   generation costs ~0 and b - a is our overhead) and, with --engine, the embedded engine
   (`start_embedded_engine`) on the same model folder. "own" is each b request's latency less the time the
   server waited on /generate (its turn's `generation_time_s`): the session server's own cost, HTTP included.
2. Tokenising per turn, replayed offline on the conversations of 1: the suffix-only plan (the earlier turn's
   exact ids + the template's new suffix) against rendering and tokenising the whole history again. The server
   as written does both: the full re-tokenisation is what its `retokenize_mismatch` stat compares against.
3. `SessionTree` costs on a synthetic long compacted session (token ids only, no server): per-turn
   `add_turn` (the tree insert), `path()` (the prompt prefix of a continued turn), `extended_turn`, then
   `segments()`.
4. The retokenize mismatch rate the server reported for each backend of 1. The stand-in's reply text is not the
   decoding of its ids ("<id>" pieces), so its rate only says the check fires; the engine's is a tokenizer figure.

The tiny test model (`tests.fakes.tiny_model`, random weights, 1k-token BPE) is built in a temporary folder unless
--model names a folder (e.g. ~/.cache/grpoflow/models/<hash>). A random model rarely emits EOS, so on a vocabulary
of at most 4096 ids the engine's turns stop at the top eighth of the ids (`stop_token_ids`); the stand-in's
turns stop at the stop string "0>" (about one token in ten). A turn cut off at --max-tokens ends its session in
both paths (the session server closes that path, as a harness would see).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from grpoflow.config import EmbeddedEngine, EpisodeConfig, SamplingConfig, Terminus2Harness  # noqa: E402
from grpoflow.engine.launch import start_embedded_engine  # noqa: E402
from grpoflow.rollout.sessions.segments import segments  # noqa: E402
from grpoflow.rollout.sessions.server import SessionServer, SessionSettings  # noqa: E402
from grpoflow.rollout.sessions.tree import SessionTree  # noqa: E402
from grpoflow.tokens import (  # noqa: E402
    encode,
    load_tokenizer,  # noqa: E402
    render,
    suffix_ids,
)
from tests.fakes.sglang_standin import StandinServer  # noqa: E402
from tests.fakes.tiny_model import build_tiny_model  # noqa: E402

SYSTEM = "You are a helpful assistant that replies with one bash command. Think briefly, then act."
_WORDS = (
    "drwxr-xr-x",
    "-rw-r--r--",
    "user",
    "staff",
    "4096",
    "src",
    "main.py",
    "README.md",
    "build",
    "tests",
    "error:",
    "warning:",
    "line",
    "No such file or directory",
    "exit code 0",
    "Traceback",
    "import",
    "42",
    "notes.txt",
    "greeting.txt",
    "passed",
    "failed",
    "Makefile",
    "config.json",
    "ok",
)


def observation(rng: random.Random, chars: int) -> str:
    """A fake tool output of about `chars` characters (ls/pytest-like lines)."""
    lines, n = [], 0
    while n < chars:
        line = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 8)))
        lines.append(line)
        n += len(line) + 1
    return "\n".join(lines)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else float("nan")


# --- 1. per-request overhead -------------------------------------------------------------------------------


def converse(
    http: httpx.Client, url: str, sid: int, args, extra: dict, lat: list[float], headers: dict | None = None
) -> int:
    """One agent session of `args.turns` turns against `url` (a chat completions endpoint); appends each request's
    latency (s) to `lat`; returns the number of turns cut off at the token limit (0 or 1: it ends the session)."""
    rng = random.Random(sid)
    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Task {sid}: find the failing test and fix it."},
    ]
    for turn in range(args.turns):
        body = {
            "model": "policy",
            "messages": msgs,
            "max_tokens": args.max_tokens,
            "temperature": 1.0,
            "seed": 1000 * sid + turn,
            **extra,
        }
        t0 = time.perf_counter()
        r = http.post(url, json=body, headers=headers)
        lat.append(time.perf_counter() - t0)
        if r.status_code != 200:
            raise SystemExit(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "length":
            return 1
        msgs = msgs + [
            {"role": "assistant", "content": choice["message"]["content"] or ""},
            {"role": "user", "content": observation(rng, args.obs_chars)},
        ]
    return 0


def overhead(name: str, backend_url: str, model: Path, args, extra: dict) -> tuple[list, dict]:
    """Runs 1 over one backend; prints a row per path; returns (the session trees, the server's stats)."""
    direct = f"{backend_url}/v1/chat/completions"
    lat: dict[str, list[float]] = {"a": [], "b": []}
    cut = {"a": 0, "b": 0}
    trees = []
    with (
        SessionServer(
            SessionSettings(
                backend_url,
                str(model),
                EmbeddedEngine(request_timeout_s=600.0, outage_wait_s=0.0),
                SamplingConfig(max_new_tokens=args.max_tokens, temperature=1.0),
                EpisodeConfig(),
                Terminus2Harness(),
            )
        ) as srv,
        httpx.Client(timeout=600.0) as http,
    ):
        # warm-up (connections, template compilation, the engine's first forward): not counted
        converse(http, direct, 999, args, extra, [])

        def bearer(name: str) -> dict:
            return {"Authorization": f"Bearer {srv.session_token(name)}"}

        converse(http, srv.session_url("warmup") + "/chat/completions", 999, args, extra, [], bearer("warmup"))
        srv.pop_session("warmup")
        warm = srv.stats()
        for sid in range(args.sessions):  # alternate the paths so both see the same machine load
            cut["a"] += converse(http, direct, sid, args, extra, lat["a"])
            url = srv.session_url(f"s{sid}") + "/chat/completions"
            cut["b"] += converse(http, url, sid, args, extra, lat["b"], bearer(f"s{sid}"))
        trees = [srv.pop_session(f"s{sid}") for sid in range(args.sessions)]
        stats = {k: v - warm.get(k, 0.0) for k, v in srv.stats().items()}
    n = stats["requests"]
    stats["retokenize_mismatch_rate"] = stats["retokenize_mismatches"] / n if n else 0.0
    a, b = lat["a"], lat["b"]
    # each request of b is one turn of its session's tree, in the same order: its latency less its /generate wait
    gen = [t.generation_time_s for tree in trees for t in tree.turns]
    own = [x - g for x, g in zip(b, gen, strict=True)]
    pa50, pa95, pb50, pb95, po50, po95 = (1000 * pct(x, q) for x in (a, b, own) for q in (0.5, 0.95))
    print(
        f"{name:<10} {len(a):>4} {pa50:>7.2f} {pa95:>7.2f} | {len(b):>4} {pb50:>7.2f} {pb95:>7.2f} | "
        f"{pb50 / pa50:>6.2f}x {pb95 / pa95:>6.2f}x | {pb50 - pa50:>+8.2f} | {po50:>7.2f} {po95:>7.2f}"
        f"   cut off: a {cut['a']}, b {cut['b']}"
    )
    return trees, stats


# --- 2. tokenising per turn ---------------------------------------------------------------------------------


def retokenise(name: str, tok, trees: list[SessionTree]) -> None:
    """Replays every continued turn of `trees`: suffix-only plan vs the whole history re-tokenised."""
    rows: dict[int, list] = {}
    for tree in trees:
        for t in tree.turns:
            if t.extends is None:
                continue
            prev = tree.turns[t.extends]
            t0 = time.perf_counter()
            full_text = render(tok, t.messages, None, generation_prompt=True)
            t1 = time.perf_counter()
            full = encode(tok, full_text)
            t2 = time.perf_counter()
            suffix = suffix_ids(tok, t.messages, len(prev.messages) + 1, prev.reply, prev.output_ids, None, full_text)
            t3 = time.perf_counter()
            rows.setdefault(t.index, []).append((len(full), len(suffix), t1 - t0, t2 - t1, t3 - t2))
    if not rows:
        print(f"{name:<10} no continued turns")
        return
    tot = [0.0] * 5
    for i in sorted(rows):
        r = rows[i]
        sums = [sum(x[k] for x in r) for k in range(5)]
        tot = [a + b for a, b in zip(tot, sums, strict=True)]
        full_ms, suf_ms = 1000 * (sums[2] + sums[3]) / len(r), 1000 * (sums[2] + sums[4]) / len(r)
        print(
            f"{name:<10} {i:>4} {len(r):>4} {sums[0] / len(r):>9.0f} {sums[1] / len(r):>9.0f} "
            f"{sums[0] / max(sums[1], 1):>6.1f}x | {full_ms:>8.3f} {suf_ms:>8.3f} {full_ms / suf_ms:>6.2f}x"
        )
    n = sum(len(r) for r in rows.values())
    full_ms, suf_ms = 1000 * (tot[2] + tot[3]) / n, 1000 * (tot[2] + tot[4]) / n
    both_ms = 1000 * (tot[2] + tot[3] + tot[4]) / n
    print(
        f"{name:<10} {'all':>4} {n:>4} {tot[0] / n:>9.0f} {tot[1] / n:>9.0f} {tot[0] / max(tot[1], 1):>6.1f}x | "
        f"{full_ms:>8.3f} {suf_ms:>8.3f} {full_ms / suf_ms:>6.2f}x   server as written (both): {both_ms:.3f} ms"
        f" (render {1000 * tot[2] / n:.3f}, encode full {1000 * tot[3] / n:.3f}, suffix {1000 * tot[4] / n:.3f})"
    )


# --- 3. tree and segments -----------------------------------------------------------------------------------


def build_compacted(args, vocab: int, seed: int) -> tuple[SessionTree, dict[str, list[float]], list[int]]:
    """A session of `tree_turns` turns and about `tree_tokens` new tokens, compacted `tree_branches` times: at
    each compaction a summarisation request branches off the end of the context, and the main loop restarts
    from the system prompt + the summary (a branch near the root). Returns (tree, timings, prompt lengths)."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    per_turn = max(2, args.tree_tokens // args.tree_turns)
    out_len = max(1, per_turn // 5)
    obs_len = per_turn - out_len
    period = max(2, args.tree_turns // (args.tree_branches + 1))
    system = ids(100)
    tree = SessionTree("bench")
    times: dict[str, list[float]] = {"add_turn": [], "path": [], "extended_turn": []}
    prompt_lens: list[int] = []
    context = system + ids(obs_len)
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    prev = None
    compactions = 0
    for i in range(args.tree_turns):
        summarise = compactions < args.tree_branches and i % period == period - 1
        if summarise:
            msgs = msgs + [{"role": "user", "content": f"summarise {i}"}]
            context = context + ids(50)
        t0 = time.perf_counter()
        ext = tree.extended_turn(msgs)
        t1 = time.perf_counter()
        if prev is not None and ext is not None:
            tree.path(prev.end)  # the server's prompt prefix for a continued turn
        t2 = time.perf_counter()
        out = ids(4 * out_len if summarise else out_len)
        t3 = time.perf_counter()
        turn = tree.add_turn(
            msgs,
            context,
            out,
            [-0.5] * len(out),
            reply=f"r{i}",
            finish_reason="stop",
            truncated=False,
            extends=ext.index if ext is not None else None,
            retokenize_mismatch=False,
            first_mismatch=None,
            weight_version="0",
            generation_time_s=0.0,
        )
        t4 = time.perf_counter()
        times["extended_turn"].append(t1 - t0)
        times["path"].append(t2 - t1)
        times["add_turn"].append(t4 - t3)
        prompt_lens.append(len(context))
        if summarise:  # restart: system prompt + the summary as the new user message
            compactions += 1
            msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": f"summary {i}"}]
            context = system + out + ids(obs_len)
            prev = None
            continue
        msgs = msgs + [{"role": "assistant", "content": f"r{i}"}, {"role": "user", "content": f"obs {i}"}]
        context = context + out + ids(obs_len)
        prev = turn
    return tree, times, prompt_lens


def tree_costs(args, vocab: int) -> None:
    best: dict[str, float] = {}
    for rep in range(args.repeats):  # shared machine: the best of the repeats per figure
        tree, times, prompt_lens = build_compacted(args, vocab, seed=rep)
        t0 = time.perf_counter()
        segs = segments(tree)
        seg_s = time.perf_counter() - t0
        figs = {"segments": seg_s}
        for k, xs in times.items():
            figs[f"{k}_mean"] = sum(xs) / len(xs)
            figs[f"{k}_p95"] = pct(xs, 0.95)
            figs[f"{k}_max"] = max(xs)
        best = {k: min(v, best.get(k, v)) for k, v in figs.items()}
    positions = _tree_positions(tree.root)
    seg_tokens = sum(len(s.tokens) for s in segs)
    trained = sum(sum(s.loss_mask) for s in segs)
    print(
        f"session: {len(tree.turns)} turns, {positions} token positions in the tree, {len(segs)} segments "
        f"({seg_tokens} tokens in all, {trained} trained), longest prompt {max(prompt_lens)} tokens"
    )
    print(f"{'per turn':<16} {'mean ms':>9} {'p95 ms':>9} {'max ms':>9}")
    for k in ("add_turn", "path", "extended_turn"):
        print(
            f"{k:<16} {1000 * best[k + '_mean']:>9.3f} {1000 * best[k + '_p95']:>9.3f} {1000 * best[k + '_max']:>9.3f}"
        )
    print(
        f"segments(): {1000 * best['segments']:.2f} ms for the whole session "
        f"({1e6 * best['segments'] / positions:.2f} us per tree position); best of {args.repeats}"
    )


def _tree_positions(node) -> int:
    total, stack = 0, [node]
    while stack:
        n = stack.pop()
        total += len(n.tokens)
        stack.extend(n.children.values())
    return total


def mismatch_sites(trees: list[SessionTree]) -> dict[str, int]:
    """Where each mismatching request's prompt first differs from its re-tokenised history: inside the ids of an
    earlier reply it reuses, at such a reply's last id or the EOS the server appended after it, or elsewhere."""
    out = {"inside": 0, "end": 0, "other": 0}
    for tree in trees:
        for t in tree.turns:
            if not t.retokenize_mismatch or t.first_mismatch is None:
                continue
            pos, kind, e = t.first_mismatch, "other", t.extends
            while e is not None:  # the replies this prompt reuses, newest first
                prev = tree.turns[e]
                start, end = prev.prompt_len, prev.prompt_len + len(prev.output_ids)
                if start <= pos < end - 1:
                    kind = "inside"
                    break
                if pos in (end - 1, end):
                    kind = "end"
                    break
                e = prev.extends
            out[kind] += 1
    return out


# --- main ---------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="HF model folder (default: the tiny test model).")
    ap.add_argument("--engine", action="store_true", help="Also run 1, 2 and 4 over the embedded engine.")
    ap.add_argument("--threads", type=int, default=1, help="The embedded engine's torch threads.")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6, help="Requests per session (fewer if a turn is cut off).")
    ap.add_argument("--obs-chars", type=int, default=400, help="Characters of each turn's tool observation.")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--tree-turns", type=int, default=60)
    ap.add_argument("--tree-tokens", type=int, default=30000, help="New tokens over the synthetic session.")
    ap.add_argument("--tree-branches", type=int, default=3, help="Summarisation branches (compactions).")
    ap.add_argument("--repeats", type=int, default=3, help="Builds of the synthetic session; best is shown.")
    args = ap.parse_args()

    tmp = None
    if args.model is None:
        tmp = tempfile.TemporaryDirectory()
        model = build_tiny_model(Path(tmp.name) / "tiny")
    else:
        model = args.model.expanduser()
    tok = load_tokenizer(str(model))
    vocab = len(tok)
    print(
        f"model {model} (tokenizer vocab {vocab}); {args.sessions} sessions x {args.turns} turns, "
        f"observations {args.obs_chars} chars, max_tokens {args.max_tokens}"
    )

    print(
        "\n1. latency per request: (a) straight to the backend's /v1/chat/completions, (b) through the session "
        "server (ms)"
    )
    print(
        f"{'backend':<10} {'n':>4} {'a p50':>7} {'a p95':>7} | {'n':>4} {'b p50':>7} {'b p95':>7} | "
        f"{'b/a p50':>7} {'b/a p95':>7} | {'b-a p50':>8} | {'own p50':>7} {'own p95':>7}"
    )
    runs = []
    # The stand-in's context length is the model's; lift it so long histories are served (its "tokens" are bytes).
    with StandinServer(str(model), context_length=1 << 20) as standin:
        trees, stats = overhead("stand-in", standin.url, model, args, {"stop": ["0>"]})
        runs.append(("stand-in", trees, stats))
    if args.engine:
        extra = {"stop_token_ids": list(range(vocab - vocab // 8, vocab))} if vocab <= 4096 else {}
        eng = start_embedded_engine(model, threads=args.threads, max_batch_size=8)
        try:
            trees, stats = overhead("engine", eng.url, model, args, extra)
        finally:
            eng.stop()
        runs.append(("engine", trees, stats))

    print(
        "\n2. tokenising per continued turn (replayed offline): whole history re-rendered and tokenised vs the "
        "server's suffix-only plan"
    )
    print(
        f"{'backend':<10} {'turn':>4} {'n':>4} {'full tok':>9} {'sfx tok':>9} {'ratio':>7} | "
        f"{'full ms':>8} {'sfx ms':>8} {'ratio':>7}"
    )
    for name, trees, _ in runs:
        retokenise(name, tok, trees)
    print(
        "(full ms = render + encode the whole history; sfx ms = render + suffix_ids, which renders the earlier "
        "turn's messages and encodes the suffix)"
    )

    print(
        f"\n3. SessionTree on a synthetic compacted session ({args.tree_turns} turns, ~{args.tree_tokens} new "
        f"tokens, {args.tree_branches} summarisation branches)"
    )
    tree_costs(args, vocab)

    print(
        "\n4. retokenize mismatch rate the server reported (requests whose whole history, re-tokenised, differs "
        "from the prompt ids it sent)"
    )
    for name, trees, s in runs:
        note = "  (stand-in text is not the decoding of its ids: not a tokenizer figure)" if name == "stand-in" else ""
        print(
            f"{name:<10} {s['requests']:.0f} requests, {s['requests_extended']:.0f} continued a turn, "
            f"{s['retokenize_mismatches']:.0f} mismatched: rate {s['retokenize_mismatch_rate']:.1%}, "
            f"extend failures {s['extend_failures']:.0f}{note}"
        )
        where = mismatch_sites(trees)
        print(
            f"{'':<10} first difference: {where['inside']} inside an earlier reply's ids (not the canonical "
            f"split of its text), {where['end']} at a reply's end (stop token / EOS), {where['other']} elsewhere"
        )
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
