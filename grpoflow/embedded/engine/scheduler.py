"""Continuous-batching generation over a Hugging Face causal LM on CPU. No HTTP in here.

One background thread owns the model; work arrives in a FIFO inbox. Requests join the running batch between
decode steps (their prompts prefilled together, on top of what the prefix cache holds) and leave it when they
finish, so concurrent requests share each forward pass. Each request samples with its own seeded generator, so
its tokens do not depend on its batch-mates (up to logits rounding). A weight update is an inbox item like a
request: it waits for the requests that arrived before it, as SGLang's `/update_weights_from_disk` does.
Layout, batched prefill, determinism and the one departure from SGLang: docs/embedded.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import queue
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from grpoflow.embedded.engine.kv_cache import BatchKVCache, kv_tensors
from grpoflow.embedded.engine.lora import AdapterSlot
from grpoflow.embedded.engine.packed_linear import pack_linears, repack_linears
from grpoflow.embedded.engine.prefix_cache import PrefixCache
from grpoflow.embedded.engine.sampling import sample_next_tokens
from grpoflow.embedded.engine.weights import load_named_tensors, read_safetensors_dir
from grpoflow.engine.protocol import (
    WEIGHT_SESSION_ALREADY_OPEN,
    WEIGHT_SESSION_NOT_OPEN,
    SamplingParams,
    outside_weight_session,
)
from grpoflow.engine.shared_tensors import deserialize_named_tensors
from grpoflow.engine.update_group import (
    UPDATE_GROUP_TIMEOUT_S,
    join_update_group,
    leave_update_group,
    receive_tensors,
    torch_dtype,
)
from grpoflow.errors import EngineError, GrpoflowError, ModelError

log = logging.getLogger(__name__)

_STOP_STRING_SLACK = 8  # extra tail tokens decoded when looking for a stop string (partial UTF-8, specials)
# Padded (or recomputed) tokens a prefill group may carry beyond a quarter of its real tokens, and the least
# saving worth deferring a prompt to the next round for: about what one more forward pass costs on a CPU
# (SmolLM2-135M, one core: a forward costs ~20 ms plus ~1.3 ms per token).
_PREFILL_SLACK_TOKENS = 32


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
    """Cumulative counters; `Scheduler.internal_state()` serves them (GET /get_server_info)."""

    busy_time_s: float = 0.0  # wall time in prefill and decode (forwards, sampling, batch bookkeeping); not idle
    prefills: int = 0  # requests prefilled
    prefill_forwards: int = 0  # batched prefill forward passes
    prefill_tokens: int = 0  # prompt tokens run through the model (not reused from the prefix cache, no padding)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prefill_padding_tokens: int = 0  # padding columns computed in prefill forwards
    decode_steps: int = 0
    generated_tokens: int = 0
    requests_finished: int = 0  # requests answered with a result
    max_rows: int = 0  # most rows seen in one decode step
    weight_updates: int = 0


@dataclass(eq=False)
class _Job:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    lora_path: str | None
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
    """A change to what the engine serves, applied between batches in the queue's order: new weights, an
    adapter loaded or unloaded, or a new version label."""

    apply: Callable[[], str]  # makes the change (nothing changed if it raises); returns what it did
    source: str  # where it comes from, for messages
    weight_version: str | None  # the version to report from now on (None: the next number, with `bump`)
    future: Future
    bump: bool = True  # a new weight version: the weights changed, or the label was set
    touches_weights: bool = True  # the packed copies and the prefix cache are stale after it


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
        pack_weights: bool = True,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model_path = str(model_path)
        self.weights_path = self.model_path  # the dir the weights were last loaded from (SGLang's /model_info)
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
        # Linears on oneDNN with pre-packed weights (2x faster than MKL here); 0 when off or unsupported.
        self.packed_linears = pack_linears(self.model) if pack_weights else 0
        self.seed = seed
        self.max_batch_size = max_batch_size  # read at every admission; the bench changes it between runs
        self.weight_version = weight_version
        # weight-update process groups joined, by name
        self.update_groups: dict[str, torch.distributed.ProcessGroup] = {}
        self._shared_tensors: dict[str, torch.Tensor] = {}  # the last update_weights_from_tensor's, mapped
        self._weight_session = False  # between begin_weight_update and end_weight_update (SGLang's rule)
        self.adapter = AdapterSlot(self.model)  # the LoRA adapter merged into the served weights, if any
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
        lora_path: str | None = None,
    ) -> Future:
        """Queue one generation; the future resolves to a `GenerationResult`. Raises `InvalidRequest`.
        `lora_path`: the adapter the request asks for (SGLang's name); it must be the one loaded, if any."""
        params = params or SamplingParams()
        self._validate(input_ids)
        job = _Job(
            rid=rid or uuid.uuid4().hex,
            input_ids=list(input_ids),
            params=params,
            return_logprob=return_logprob,
            lora_path=lora_path,
            future=Future(),
            generator=torch.Generator(),
            max_new_tokens=min(params.max_new_tokens, self.context_length - len(input_ids)),
            # SGLang's rule (schedule_batch.py _check_token_based_finish): ignore_eos ends no reply at any token,
            # stop_token_ids included; stop strings still apply.
            stop_ids=frozenset() if params.ignore_eos else frozenset(params.stop_token_ids or ()) | self.eos_ids,
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

    def update_weights(
        self,
        load: Callable[[], dict[str, torch.Tensor]],
        source: str,
        weight_version: str | None = None,
        whole: bool = True,
    ) -> Future:
        """Queue a weight update: once earlier requests finished, `load()` (in the scheduler's thread) gives the
        new tensors by name and they replace the model's; the future resolves to a `WeightUpdateResult`.
        `whole`: a checkpoint, every tensor, and a new version (`weight_version`, else the next number). Else a
        part of the model, as SGLang's in-memory updates take it (a bucket of a sync): the version changes only
        when one is given (the sync's last bucket gives it)."""

        def apply() -> str:
            if self.adapter.name is not None:  # the merged adapter would be lost under new base weights
                raise ModelError(f"adapter {self.adapter.name!r} is loaded: unload it before new base weights")
            return f"loaded {load_named_tensors(self.model, load(), source, whole)} tensors from {source}"

        return self._queue(_Update(apply, source, weight_version, Future(), bump=whole or weight_version is not None))

    def load_lora_adapter(self, name: str, path: str) -> Future:
        """Merge PEFT's adapter at `path` into the served weights as `name` (`grpoflow.embedded.engine.lora`)."""

        def apply() -> str:
            return f"loaded adapter {name!r} ({self.adapter.load(name, path)} linears)"

        return self._queue(_Update(apply, path, None, Future(), bump=False))

    def unload_lora_adapter(self, name: str) -> Future:
        return self._queue(
            _Update(lambda: self.adapter.unload(name) or f"unloaded adapter {name!r}", name, None, Future(), bump=False)
        )

    def update_weight_version(self, version: str) -> Future:
        """Report `version` from now on (SGLang's /update_weight_version): after an adapter load, say which."""
        return self._queue(_Update(lambda: "weight version set", version, version, Future(), touches_weights=False))

    def _queue(self, upd: _Update) -> Future:
        with self._lock:
            if self._closed:
                raise EngineError("engine is shut down; cannot update weights")
            self._inbox.put(upd)
        return upd.future

    def begin_weight_update(self) -> WeightUpdateResult:
        """Open the weight-update session the in-memory updates need, as SGLang's scheduler does (its messages)."""
        with self._lock:
            if self._weight_session:
                return WeightUpdateResult(False, WEIGHT_SESSION_ALREADY_OPEN, self.weight_version)
            self._weight_session = True
        return WeightUpdateResult(True, "Success", self.weight_version)

    def end_weight_update(self) -> WeightUpdateResult:
        with self._lock:
            if not self._weight_session:
                return WeightUpdateResult(False, WEIGHT_SESSION_NOT_OPEN, self.weight_version)
            self._weight_session = False
        return WeightUpdateResult(True, "Success", self.weight_version)

    def _refused_outside_session(self, route: str) -> Future | None:
        """A resolved refusal of `route` outside a weight-update session (SGLang checks it before anything else),
        else None."""
        with self._lock:
            if self._weight_session:
                return None
        refused: Future = Future()
        refused.set_result(WeightUpdateResult(False, outside_weight_session(route), self.weight_version))
        return refused

    def update_weights_from_disk(self, model_path: str | Path, weight_version: str | None = None) -> Future:
        fut = self.update_weights(lambda: read_safetensors_dir(model_path), str(model_path), weight_version)

        def loaded(done: Future) -> None:  # in the scheduler's thread, before the caller hears of it
            if done.result().success:
                self.weights_path = str(model_path)

        fut.add_done_callback(loaded)
        return fut

    def init_weights_update_group(
        self, address: str, port: int, rank: int, world_size: int, group_name: str, backend: str
    ) -> None:
        """Join the trainer's weight-update group (blocks until every rank joined); gloo only (no GPU here)."""
        if backend != "gloo":
            raise InvalidRequest(f"backend {backend!r}: the embedded engine runs on the CPU, so only `gloo`")
        if group_name in self.update_groups:
            raise InvalidRequest(f"weight update group {group_name!r} exists already")
        group = join_update_group(address, port, rank, world_size, group_name, backend, UPDATE_GROUP_TIMEOUT_S)
        self.update_groups[group_name] = group

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None = None,
    ) -> Future:
        """Queue an update whose tensors the trainer broadcasts over `group_name` (received in order); only inside
        a weight-update session."""
        refused = self._refused_outside_session("update_weights_from_distributed")
        if refused is not None:
            return refused
        group = self.update_groups.get(group_name)
        if group is None:
            raise InvalidRequest(f"no weight update group {group_name!r}: POST /init_weights_update_group first")
        if not len(names) == len(dtypes) == len(shapes):
            raise InvalidRequest(f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes")
        for d in dtypes:
            try:
                torch_dtype(d)
            except ValueError as e:  # refused before anything is received
                raise InvalidRequest(f"dtypes: {e}") from e
        return self.update_weights(
            lambda: receive_tensors(group, names, dtypes, shapes), f"group {group_name}", weight_version, whole=False
        )

    def update_weights_from_tensor(
        self, serialized: list[str], load_format: str | None, weight_version: str | None = None
    ) -> Future:
        """Queue an update from tensors in this host's shared memory (`grpoflow.engine.shared_tensors`); only
        inside a weight-update session."""
        refused = self._refused_outside_session("update_weights_from_tensor")
        if refused is not None:
            return refused
        if load_format is not None:
            raise InvalidRequest(f"load_format {load_format!r}: the embedded engine reads (name, tensor) pairs only")
        if len(serialized) != 1:
            raise InvalidRequest(f"{len(serialized)} serialized_named_tensors: the embedded engine is one rank")

        def load() -> dict[str, torch.Tensor]:
            try:
                named = dict(deserialize_named_tensors(serialized[0]))
            except ValueError as e:
                raise ModelError(f"serialized_named_tensors: {e}") from e
            # Held until the next one: a trainer reuses its buffer, and torch maps a buffer that is still held
            # once, so the next update skips mapping (and faulting in) the whole model again.
            self._shared_tensors = named
            return named

        return self.update_weights(load, "shared tensors", weight_version, whole=False)

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
        for group in self.update_groups.values():
            leave_update_group(group)
        self.update_groups.clear()

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def internal_state(self) -> dict:
        """The counters of `SchedulerStats` plus queue sizes: one entry of /get_server_info's `internal_states`.

        Safe from any thread; a snapshot of plain numbers, not atomic across fields."""
        state = dataclasses.asdict(self.stats)
        state.update(
            running_requests=len(self._rows),
            waiting_requests=len(self._waiting) + self._inbox.qsize(),
            weight_version=self.weight_version,
            prefix_cache_tokens=self.prefix_cache.cached_tokens,
            prefix_cache_hits=self.prefix_cache.stats.hits,
            packed_linears=self.packed_linears,
            torch_threads=torch.get_num_threads(),
        )
        return state

    # --- scheduler thread ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        """Add the block's wall time to `stats.busy_time_s`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stats.busy_time_s += time.perf_counter() - start

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
                        with self._busy():
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
        starting: list[_Job] = []
        while self._waiting:
            head = self._waiting[0]
            if isinstance(head, _Update):
                if self._rows or starting:
                    break  # later requests wait behind the update
                self._waiting.popleft()
                self._apply_update(head)
                continue
            if len(self._rows) + len(starting) >= self.max_batch_size:
                break
            self._waiting.popleft()
            if not head.future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            if head.lora_path != self.adapter.name:  # checked here: the updates queued before it have run
                served = f"adapter {self.adapter.name!r} merged into the base" if self.adapter.name else "the base"
                head.future.set_exception(
                    InvalidRequest(f"lora_path {head.lora_path!r}: this engine serves {served} model now")
                )
                continue
            head.weight_version = self.weight_version
            if head.max_new_tokens <= 0:
                self._complete(head, {"type": "length", "length": 0})
                continue
            starting.append(head)
        if starting:
            with self._busy():
                self._start(starting)

    def _start(self, jobs: list[_Job]) -> None:
        """Prefill `jobs` in as few forwards as padding and shared prefixes allow, then join them to the batch."""
        parts: list[tuple[list[_Job], list, torch.Tensor]] = []
        pending = jobs
        while pending:  # each round's prefill fills the prefix cache for the prompts it defers
            now, pending = self._defer_shared_prefixes(pending)
            for group in self._prefill_groups(now):
                try:
                    part = self._prefill(group)
                except Exception as e:  # noqa: BLE001 - fail this group only
                    log.exception("prefill failed for %d requests", len(group))
                    error = EngineError(f"prefill failed: {type(e).__name__}: {e}")
                    for job in group:
                        if not job.future.done():  # some may have finished on their first token
                            job.future.set_exception(error)
                    continue
                if part is not None:
                    parts.append(part)
        if parts:
            try:
                self._join(parts)
            except Exception as e:  # noqa: BLE001 - the batch may be half-built: fail it and the joiners
                n = sum(len(rows) for rows, _, _ in parts)
                log.exception("joining %d requests to the batch failed", n)
                error = EngineError(f"joining the batch failed: {type(e).__name__}: {e}")
                for rows, _, _ in parts:
                    for job in rows:
                        job.future.set_exception(error)
                self._fail_rows(error)

    def _defer_shared_prefixes(self, jobs: list[_Job]) -> tuple[list[tuple[int, _Job]], list[_Job]]:
        """Split `jobs` into (prefill now, with its uncached length; prefill next round): a job waits when an
        earlier job's prompt, once prefilled and cached, would give it a longer cached prefix than it has now by
        more than a forward pass costs. Otherwise a batched prefill would compute a shared prefix once per row."""
        cache = self.prefix_cache
        now: list[tuple[int, _Job]] = []
        later: list[_Job] = []
        leaders: list[np.ndarray] = []  # prompts of `now` that will be cached
        for job in jobs:
            ids = np.asarray(job.input_ids, dtype=np.int64)
            cached = cache.match_length(job.input_ids)
            shared = max((_common_prefix(ids, other) for other in leaders), default=0)
            shared = min(shared, len(ids) - 1)  # the last prompt token always runs
            if shared >= cache.min_match and shared - cached > _PREFILL_SLACK_TOKENS:
                later.append(job)
                continue
            now.append((len(ids) - cached, job))
            if cache.min_match <= len(ids) <= cache.max_tokens:
                leaders.append(ids)
        return now, later

    @staticmethod
    def _prefill_groups(jobs: list[tuple[int, _Job]]) -> list[list[_Job]]:
        """Split (uncached length, job) pairs into prefill groups whose padding stays small.

        Every row of a group runs as many tokens as the group's longest uncached part: rows are sorted by that
        length and a group is closed when the next row would make padding exceed a quarter of the real tokens
        plus `_PREFILL_SLACK_TOKENS`."""
        sized = sorted(jobs, key=lambda item: item[0])
        groups: list[list[_Job]] = []
        group: list[_Job] = []
        real = 0
        for n, job in sized:
            padding = (len(group) + 1) * n - (real + n)  # n is the widest so far
            if group and padding > (real + n) // 4 + _PREFILL_SLACK_TOKENS:
                groups.append(group)
                group, real = [], 0
            group.append(job)
            real += n
        if group:
            groups.append(group)
        return groups

    def _prefill(self, jobs: list[_Job]) -> tuple[list[_Job], list, torch.Tensor] | None:
        """One forward over `jobs`' prompts, then their first tokens; return (rows, KV, mask) of those going on.

        Layout: cached KV (B, H, P, D) + input (B, n), n = the longest uncached part. Row b runs its last n tokens
        (left-padded if shorter) over its first L_b - n cached ones, so its real tokens are the last L_b of the
        P + n columns: plain left padding, as in the decode batch."""
        cache = self.prefix_cache
        lengths = [len(j.input_ids) for j in jobs]
        n = max(length - cache.match_length(j.input_ids) for j, length in zip(jobs, lengths, strict=True))
        hits = [cache.lookup(j.input_ids, limit=max(length - n, 0)) for j, length in zip(jobs, lengths, strict=True)]
        past = [reused for reused, _ in hits]  # cached columns each row uses: L_b - n, or 0
        width = max(past)
        rows = len(jobs)
        ids = torch.zeros(rows, n, dtype=torch.long)  # pad id 0: any valid id, the mask hides it
        for b, job in enumerate(jobs):
            tail = job.input_ids[past[b] :]  # (<= n,)
            ids[b, n - len(tail) :] = torch.tensor(tail)
        length = torch.tensor(lengths).unsqueeze(1)  # (B, 1)
        positions = (torch.arange(n) + length - n).clamp_(min=0)  # (B, n): padding gets 0, masked anyway
        mask = (torch.arange(width + n) >= width + n - length).long()  # (B, P + n): the last L_b columns
        padded = bool((mask == 0).any())
        out = self.model(
            input_ids=ids,
            attention_mask=mask if padded else None,  # None: no padding, sdpa runs causal without a mask
            position_ids=positions,
            past_key_values=BatchKVCache(_stack_past(hits, width)) if width else None,
            use_cache=True,
            logits_to_keep=1,
        )
        # Padding columns hold KV computed from pad tokens: finite (SDPA gives 0 for fully masked query rows) and
        # never attended to, like the zeros of F.pad elsewhere.
        kv = kv_tensors(out.past_key_values)  # per layer: (B, H, P + n, D)
        self.stats.prefills += rows
        self.stats.prefill_forwards += 1
        self.stats.prefill_tokens += sum(lengths) - sum(past)
        self.stats.cached_tokens += sum(past)
        self.stats.prefill_padding_tokens += rows * n - (sum(lengths) - sum(past))
        for b, job in enumerate(jobs):
            job.length = lengths[b]
            row_kv = [(k[b : b + 1, :, -job.length :], v[b : b + 1, :, -job.length :]) for k, v in kv]  # (1, H, L_b, D)
            cache.insert(job.input_ids, row_kv)
        tokens, lps = sample_next_tokens(out.logits[:, -1], [j.params for j in jobs], [j.generator for j in jobs])
        going_on = []
        for b, (job, tok, lp) in enumerate(zip(jobs, tokens, lps, strict=True)):
            reason = self._append(job, tok, lp)
            if reason is None:
                going_on.append(b)
            else:
                self._complete(job, reason)
        if not going_on:
            return None
        return _select(jobs, kv, mask, going_on)

    def _join(self, parts: list[tuple[list[_Job], list, torch.Tensor]]) -> None:
        """Add prefilled rows to the batch in one rebuild: left-pad every part's KV to a common T, concat along B."""
        if self._rows:
            parts = [(self._rows, kv_tensors(self._cache), self._mask), *parts]
        width = max(mask.shape[1] for _, _, mask in parts)
        merged = [
            (
                torch.cat([_left_pad(kv[layer][0], width) for _, kv, _ in parts]),
                torch.cat([_left_pad(kv[layer][1], width) for _, kv, _ in parts]),
            )
            for layer in range(len(parts[0][1]))
        ]  # per layer: (B', H, width, D)
        self._mask = torch.cat([F.pad(mask, (width - mask.shape[1], 0)) for _, _, mask in parts])  # (B', width)
        self._cache = BatchKVCache(merged)
        self._rows = [job for rows, _, _ in parts for job in rows]

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
        self._rows, kv, self._mask = _select(self._rows, kv_tensors(self._cache), self._mask, keep)
        self._cache = BatchKVCache(kv)

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
        self.stats.requests_finished += 1
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
            done = upd.apply()
            if upd.touches_weights:
                repack_linears(self.model)  # the packed copies of the weights written are stale snapshots
        except GrpoflowError as e:  # raised before anything was written
            upd.future.set_result(WeightUpdateResult(False, f"weights not updated: {e}", self.weight_version))
            return
        except Exception as e:  # noqa: BLE001 - report any load failure to the caller, keep serving
            log.exception("weight update from %s failed", upd.source)
            with contextlib.suppress(Exception):
                repack_linears(self.model)  # serve what the parameters now hold, as F.linear would
            msg = f"weights not updated: {type(e).__name__}: {e} (model may be partially updated)"
            upd.future.set_result(WeightUpdateResult(False, msg, self.weight_version))
            return
        if upd.touches_weights:
            self.prefix_cache.clear()  # always, whatever flush_cache says: cached KV came from the old weights
            self.stats.weight_updates += 1
        if upd.bump:
            self.weight_version = upd.weight_version or _next_version(self.weight_version)
        msg = f"{done}; weight_version={self.weight_version}"
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


def _select(rows: list[_Job], kv: list, mask: torch.Tensor, keep: list[int]) -> tuple[list[_Job], list, torch.Tensor]:
    """Rows `keep` of a left-padded (rows, per-layer KV (B, H, T, D), mask (B, T)), minus all-padding columns."""
    rows = [rows[b] for b in keep]
    lead = mask.shape[1] - max(r.length for r in rows)
    if len(keep) == mask.shape[0] and lead == 0:
        return rows, kv, mask
    index = torch.tensor(keep)
    return rows, [(k[index, :, lead:], v[index, :, lead:]) for k, v in kv], mask[index, lead:]


def _stack_past(hits: list[tuple[int, list | None]], width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (B, H, width, D): each row's cached KV (1, H, reused, D) left-padded with zeros; rows without
    a hit are all padding."""
    ref = next(kv for _, kv in hits if kv is not None)  # any row's KV, for the empty parts' shapes
    return [
        tuple(
            torch.cat([_left_pad((kv or ref)[layer][i][:, :, :reused], width) for reused, kv in hits]) for i in (0, 1)
        )
        for layer in range(len(ref))
    ]


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


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
