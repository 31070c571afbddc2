"""Continuous-batching generation over a Hugging Face causal LM on CPU. No HTTP in here.

One background thread owns the model (fp32). Work arrives in a FIFO inbox; requests join the running batch
between decode steps and leave it when they finish, so N concurrent requests share each forward pass:

- join: the new prompt is prefilled alone (B=1), its first token sampled, then its KV cache is left-padded to
  the batch's length (or the batch's to its) and concatenated along the batch dim;
- step: one token for every active row: input (B, 1), attention mask (B, T+1), per-row position ids (B, 1);
- leave: finished rows are dropped from the cache, and cache columns that are padding for every remaining row
  are cut off.

Layout: every layer's keys/values are (B, H_kv, T, D), row b's real tokens are the last `length_b` columns
(left padding), and `_mask` (B, T) marks them. Positions are per row, so padding never shifts RoPE. Decode
steps append to the cache in place (`kv_cache.BatchKVCache`); joins and leaves rebuild it. A prompt prefills
only what its longest cached prefix does not cover (`prefix_cache.PrefixCache`: prompts after prefill,
prompt + reply after finishing; cleared on every weight update). Prefill is not chunked: a long new prompt
stalls the batch for its prefill (SGLang chunks it).

Determinism: each request samples with its own torch.Generator, seeded from `sampling_seed` or else from the
engine seed and the request's arrival number, and draws one number per sampled token, so its tokens do not
depend on which requests share its batch. They depend on the logits, which are not bit-identical between a
batch and a lone run (different matmul shapes, padding): a seeded sample can flip where two tokens' cumulative
probabilities straddle the drawn number within ~1e-6 — rare, not impossible. Logprobs agree to ~1e-6.

A weight update is an inbox item like a request, so ordering is FIFO: it waits until every request that
arrived before it has finished (the running batch drains), is applied between steps, and requests that
arrived after it run on the new weights. This is SGLang's default behaviour for `/update_weights_from_disk`
(its tokenizer manager holds a writer lock until in-flight requests end), hence `num_paused_requests` is 0.

Departure from SGLang: a request whose last allowed token is a stop token finishes with "stop", not "length";
"length" means exactly "max_new_tokens reached without a stop token".
"""

from __future__ import annotations

import hashlib
import logging
import queue
import re
import threading
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from grpoflow.engine.kv_cache import BatchKVCache, kv_tensors
from grpoflow.engine.prefix_cache import PrefixCache
from grpoflow.engine.protocol import SamplingParams
from grpoflow.engine.sampling import sample_next_tokens
from grpoflow.engine.weights import load_safetensors_dir
from grpoflow.errors import EngineError, GrpoflowError, ModelError

log = logging.getLogger(__name__)

_STOP_STRING_SLACK = 8  # extra tail tokens decoded when looking for a stop string (partial UTF-8, specials)


class InvalidRequest(ValueError):
    """The request cannot be served as given (the HTTP layer answers 400)."""


@dataclass(frozen=True)
class GenerationResult:
    rid: str
    output_ids: list[int]
    output_logprobs: list[float]  # raw log_softmax at each output token; empty unless return_logprob
    text: str
    finish_reason: dict  # SGLang shape: {"type": "stop", "matched": id|str} or {"type": "length", "length": n}
    prompt_tokens: int
    weight_version: str


@dataclass(frozen=True)
class WeightUpdateResult:
    success: bool
    message: str
    weight_version: str
    num_paused_requests: int = 0


@dataclass
class SchedulerStats:
    prefills: int = 0
    decode_steps: int = 0
    generated_tokens: int = 0
    max_rows: int = 0  # most rows seen in one decode step
    weight_updates: int = 0


@dataclass(eq=False)
class _Job:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    future: Future
    generator: torch.Generator
    max_new_tokens: int
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    length: int = 0  # tokens of this row held in the KV cache
    weight_version: str = ""


@dataclass(eq=False)
class _Update:
    model_path: str
    weight_version: str | None
    future: Future


class _Shutdown:
    pass


class Scheduler:
    """Owns a model + tokenizer and a background thread that serves `submit()` with continuous batching."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        seed: int = 0,
        threads: int | None = None,
        max_batch_size: int = 16,
        weight_version: str = "0",
        prefix_cache_tokens: int = 16384,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model_path = str(model_path)
        if not Path(self.model_path, "config.json").is_file():
            raise ModelError(f"model path {self.model_path} has no config.json")
        if threads:
            torch.set_num_threads(threads)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).eval()
        layer_types = getattr(self.model.config, "layer_types", None) or ["full_attention"]
        if set(layer_types) != {"full_attention"}:
            raise ModelError(f"{self.model_path}: only full-attention models are supported, got {set(layer_types)}")
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.context_length = int(getattr(self.model.config, "max_position_embeddings", 0) or 2048)
        self.eos_ids = _eos_ids(self.tokenizer, self.model)
        self.seed = seed
        self.max_batch_size = max_batch_size  # read at every admission; the bench changes it between runs
        self.weight_version = weight_version
        self.stats = SchedulerStats()
        self.prefix_cache = PrefixCache(prefix_cache_tokens)  # touched by the scheduler thread only

        self._inbox: queue.Queue = queue.Queue()
        self._waiting: deque[_Job | _Update] = deque()
        self._rows: list[_Job] = []
        self._cache: BatchKVCache | None = None  # KV of self._rows
        self._mask: torch.Tensor | None = None  # (B, T) long, 1 = real token
        self._counter = 0
        self._lock = threading.Lock()
        self._closed = False
        self._flush_requested = False
        self._thread = threading.Thread(target=self._run, name="grpoflow-engine-scheduler", daemon=True)
        self._thread.start()

    # --- public API (any thread) --------------------------------------------------------------------------

    def submit(
        self,
        input_ids: list[int],
        params: SamplingParams | None = None,
        *,
        return_logprob: bool = False,
        rid: str | None = None,
    ) -> Future:
        """Queue one generation; the future resolves to a `GenerationResult`. Raises `InvalidRequest`."""
        params = params or SamplingParams()
        self._validate(input_ids)
        job = _Job(
            rid=rid or uuid.uuid4().hex,
            input_ids=list(input_ids),
            params=params,
            return_logprob=return_logprob,
            future=Future(),
            generator=torch.Generator(),
            max_new_tokens=min(params.max_new_tokens, self.context_length - len(input_ids)),
            stop_ids=frozenset(params.stop_token_ids or ()) | (frozenset() if params.ignore_eos else self.eos_ids),
        )
        # Under the lock, so nothing is queued behind the shutdown marker (it would never be answered).
        with self._lock:
            if self._closed:
                raise EngineError("engine is shut down; no new requests")
            self._counter += 1
            seed = params.sampling_seed if params.sampling_seed is not None else _derive_seed(self.seed, self._counter)
            job.generator.manual_seed(seed)
            self._inbox.put(job)
        return job.future

    def generate(self, input_ids: list[int], params: SamplingParams | None = None, **kw) -> GenerationResult:
        """Blocking `submit`."""
        return self.submit(input_ids, params, **kw).result()

    def update_weights_from_disk(self, model_path: str | Path, weight_version: str | None = None) -> Future:
        """Queue a weight load; the future resolves to a `WeightUpdateResult` once earlier requests finished."""
        upd = _Update(model_path=str(model_path), weight_version=weight_version, future=Future())
        with self._lock:
            if self._closed:
                raise EngineError("engine is shut down; cannot update weights")
            self._inbox.put(upd)
        return upd.future

    def flush_cache(self) -> None:
        """Drop the prefix cache (at the scheduler's next step; it owns the cache)."""
        self._flush_requested = True

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread; queued and running requests fail with EngineError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(_Shutdown())
        self._thread.join(timeout)

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- scheduler thread ---------------------------------------------------------------------------------

    def _validate(self, input_ids: list[int]) -> None:
        if not input_ids:
            raise InvalidRequest("input_ids is empty")
        bad = next((i for i, t in enumerate(input_ids) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"input_ids[{bad}]={input_ids[bad]} is outside the vocabulary [0, {self.vocab_size})")
        if len(input_ids) >= self.context_length:
            raise InvalidRequest(
                f"prompt of {len(input_ids)} tokens leaves no room in the context length {self.context_length}"
            )

    def _run(self) -> None:
        with torch.inference_mode():
            while self._pull_inbox():
                if self._flush_requested:
                    self._flush_requested = False
                    self.prefix_cache.clear()
                try:
                    self._admit()
                    if self._rows:
                        self._decode_step()
                except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the server
                    log.exception("decode step failed; failing %d running requests", len(self._rows))
                    self._fail_rows(EngineError(f"generation failed in a decode step: {type(e).__name__}: {e}"))
        self._fail_all(EngineError("engine shut down before the request finished"))

    def _pull_inbox(self) -> bool:
        """Move inbox items to `_waiting`; block only when idle. Return False on shutdown."""
        idle = not self._rows and not self._waiting
        try:
            item = self._inbox.get(timeout=0.5) if idle else self._inbox.get_nowait()
            while True:
                if isinstance(item, _Shutdown):
                    return False
                self._waiting.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return True

    def _admit(self) -> None:
        """Start waiting work in FIFO order while there is room; apply a weight update once the batch drained."""
        joining: list[tuple[_Job, list]] = []
        while self._waiting:
            head = self._waiting[0]
            if isinstance(head, _Update):
                if self._rows or joining:
                    break  # later requests wait behind the update
                self._waiting.popleft()
                self._apply_update(head)
                continue
            if len(self._rows) + len(joining) >= self.max_batch_size:
                break
            self._waiting.popleft()
            if not head.future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                kv = self._prefill(head)
            except Exception as e:  # noqa: BLE001 - fail this request only
                log.exception("prefill failed for request %s", head.rid)
                head.future.set_exception(EngineError(f"prefill failed: {type(e).__name__}: {e}"))
                continue
            if kv is not None:
                joining.append((head, kv))
        if joining:
            try:
                self._join(joining)
            except Exception as e:  # noqa: BLE001 - the batch may be half-built: fail it and the joiners
                log.exception("joining %d requests to the batch failed", len(joining))
                error = EngineError(f"joining the batch failed: {type(e).__name__}: {e}")
                for job, _ in joining:
                    job.future.set_exception(error)
                self._fail_rows(error)

    def _prefill(self, job: _Job) -> list | None:
        """Run the prompt and sample the first token; return its per-layer KV, or None if already finished."""
        job.weight_version = self.weight_version
        if job.max_new_tokens <= 0:
            self._complete(job, {"type": "length", "length": 0})
            return None
        reused, past = self.prefix_cache.lookup(job.input_ids)
        ids = torch.tensor([job.input_ids[reused:]])  # (1, T - reused): only what the cache does not cover
        cache = BatchKVCache(past) if past is not None else None  # a copy: the cached entry stays intact
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        self.stats.prefills += 1
        job.length = len(job.input_ids)
        kv = kv_tensors(out.past_key_values)  # per layer: (1, H, T, D)
        self.prefix_cache.insert(job.input_ids, kv)
        tokens, lps = sample_next_tokens(out.logits[:, -1], [job.params], [job.generator])  # logits (1, V)
        reason = self._append(job, tokens[0], lps[0])
        if reason is not None:
            self._complete(job, reason)
            return None
        return kv

    def _join(self, joining: list[tuple[_Job, list]]) -> None:
        """Add prefilled rows to the batch in one rebuild: left-pad every part's KV to a common T, concat along B."""
        parts = [(kv, torch.ones(1, job.length, dtype=torch.long)) for job, kv in joining]
        if self._rows:
            parts.insert(0, (kv_tensors(self._cache), self._mask))
        width = max(mask.shape[1] for _, mask in parts)
        merged = [
            (
                torch.cat([_left_pad(kv[layer][0], width) for kv, _ in parts]),
                torch.cat([_left_pad(kv[layer][1], width) for kv, _ in parts]),
            )
            for layer in range(len(parts[0][0]))
        ]  # per layer: (B', H, width, D)
        self._mask = torch.cat([F.pad(mask, (width - mask.shape[1], 0)) for _, mask in parts])  # (B', width)
        self._cache = BatchKVCache(merged)
        self._rows = self._rows + [job for job, _ in joining]

    def _decode_step(self) -> None:
        rows = self._rows
        last = torch.tensor([[r.output_ids[-1]] for r in rows])  # (B, 1)
        positions = torch.tensor([[r.length] for r in rows])  # (B, 1): each row's own next position
        self._mask = torch.cat([self._mask, torch.ones(len(rows), 1, dtype=torch.long)], dim=1)  # (B, T+1)
        out = self.model(
            input_ids=last,
            attention_mask=self._mask,
            position_ids=positions,
            past_key_values=self._cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.stats.decode_steps += 1
        self.stats.max_rows = max(self.stats.max_rows, len(rows))
        for r in rows:
            r.length += 1
        tokens, lps = sample_next_tokens(out.logits[:, -1], [r.params for r in rows], [r.generator for r in rows])
        done: dict[int, dict] = {}
        for b, (r, tok, lp) in enumerate(zip(rows, tokens, lps, strict=True)):
            reason = self._append(r, tok, lp)
            if reason is not None:
                done[b] = reason
        if done:
            self._remember(done)
            self._drop(set(done))
            for b, reason in done.items():
                self._complete(rows[b], reason)

    def _append(self, job: _Job, token: int, logprob: float) -> dict | None:
        """Record one sampled token; return the finish reason if the request is now done."""
        job.output_ids.append(token)
        job.logprobs.append(logprob)
        self.stats.generated_tokens += 1
        if token in job.stop_ids:
            return {"type": "stop", "matched": token}
        stops = job.params.stop_strings
        if stops:
            window = max(len(s) for s in stops) + _STOP_STRING_SLACK
            tail = self.tokenizer.decode(job.output_ids[-window:], skip_special_tokens=True)
            hit = next((s for s in stops if s in tail), None)
            if hit is not None:
                return {"type": "stop", "matched": hit}
        if len(job.output_ids) >= job.max_new_tokens:
            return {"type": "length", "length": len(job.output_ids)}
        return None

    def _remember(self, rows: dict[int, dict]) -> None:
        """Put finished rows' prompt + reply KV in the prefix cache: the next agent turn extends them."""
        if self.prefix_cache.max_tokens <= 0:
            return
        kv = kv_tensors(self._cache)
        for b in rows:
            r = self._rows[b]
            tokens = r.input_ids + r.output_ids[:-1]  # the last sampled token never ran through the model
            self.prefix_cache.insert(
                tokens, [(k[b : b + 1, :, -r.length :], v[b : b + 1, :, -r.length :]) for k, v in kv]
            )

    def _drop(self, finished: set[int]) -> None:
        """Remove finished rows; cut the cache columns that are padding for every row left."""
        keep = [b for b in range(len(self._rows)) if b not in finished]
        if not keep:
            self._rows, self._cache, self._mask = [], None, None
            return
        self._rows = [self._rows[b] for b in keep]
        lead = self._mask.shape[1] - max(r.length for r in self._rows)  # all-padding columns on the left
        index = torch.tensor(keep)
        self._mask = self._mask[index, lead:]
        self._cache = BatchKVCache([(k[index, :, lead:], v[index, :, lead:]) for k, v in kv_tensors(self._cache)])

    def _complete(self, job: _Job, reason: dict) -> None:
        ids = job.output_ids
        try:
            if reason["type"] == "stop" and isinstance(reason["matched"], int):
                text = self.tokenizer.decode(ids[:-1], skip_special_tokens=True)  # SGLang trims the matched token
            else:
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                if reason["type"] == "stop" and reason["matched"] in text:
                    text = text[: text.find(reason["matched"])]
        except Exception as e:  # noqa: BLE001 - this request fails, the batch goes on
            job.future.set_exception(EngineError(f"decoding the output of {job.rid} failed: {type(e).__name__}: {e}"))
            return
        job.future.set_result(
            GenerationResult(
                rid=job.rid,
                output_ids=list(ids),
                output_logprobs=list(job.logprobs) if job.return_logprob else [],
                text=text,
                finish_reason=reason,
                prompt_tokens=len(job.input_ids),
                weight_version=job.weight_version,
            )
        )

    def _apply_update(self, upd: _Update) -> None:
        try:
            n = load_safetensors_dir(self.model, upd.model_path)
        except GrpoflowError as e:
            upd.future.set_result(WeightUpdateResult(False, f"weights not updated: {e}", self.weight_version))
            return
        except Exception as e:  # noqa: BLE001 - report any load failure to the caller, keep serving
            log.exception("weight update from %s failed", upd.model_path)
            msg = f"weights not updated: {type(e).__name__}: {e} (model may be partially updated)"
            upd.future.set_result(WeightUpdateResult(False, msg, self.weight_version))
            return
        self.prefix_cache.clear()  # always, whatever flush_cache says: cached KV came from the old weights
        self.weight_version = upd.weight_version or _next_version(self.weight_version)
        self.stats.weight_updates += 1
        msg = f"loaded {n} tensors from {upd.model_path}; weight_version={self.weight_version}"
        log.info(msg)
        upd.future.set_result(WeightUpdateResult(True, msg, self.weight_version))

    def _fail_rows(self, error: Exception) -> None:
        rows, self._rows, self._cache, self._mask = self._rows, [], None, None
        for r in rows:
            if not r.future.done():
                r.future.set_exception(error)

    def _fail_all(self, error: Exception) -> None:
        self._fail_rows(error)
        pending = list(self._waiting)
        self._waiting.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if not isinstance(item, _Shutdown):
                pending.append(item)
        for item in pending:
            if not item.future.done():
                item.future.set_exception(error)


def _left_pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad (B, H, T, D) on the left of T up to `width`."""
    return F.pad(x, (0, 0, width - x.shape[-2], 0))


def _eos_ids(tokenizer, model) -> frozenset[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids.update([gen_eos] if isinstance(gen_eos, int) else gen_eos)
    return frozenset(ids)


def _derive_seed(engine_seed: int, counter: int) -> int:
    """A per-request seed from the engine seed and the request's arrival number."""
    digest = hashlib.sha256(f"{engine_seed}/{counter}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _next_version(version: str) -> str:
    """Default label of the next weights: the trailing number plus one ("7" -> "8", "step-7" -> "step-8")."""
    m = re.fullmatch(r"(.*?)(\d+)", version)
    return f"{m.group(1)}{int(m.group(2)) + 1}" if m else f"{version}-1"
