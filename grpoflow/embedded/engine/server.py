"""The embedded engine's HTTP server: SGLang's endpoints over a `Scheduler`, on a CPU box.

    python -m grpoflow.embedded.engine.server --model-path DIR [--host 127.0.0.1] [--port 0] [--seed N] [--threads N]
        [--max-batch-size N] [--prefix-cache-tokens N] [--port-file PATH] [--served-model-name NAME]
        [--no-pack-weights] [--paused]

With `--port 0` the server binds a free port itself and hands the bound socket to uvicorn (no race between
picking and binding), writes the port to `--port-file` atomically and prints
`grpoflow-engine listening on http://HOST:PORT`.

Endpoints: POST /generate, POST /update_weights_from_disk, POST /init_weights_update_group (gloo),
POST /begin_weight_update and /end_weight_update (the session the next two need, as in SGLang),
POST /update_weights_from_distributed, POST /update_weights_from_tensor (same host), POST /load_lora_adapter, POST /unload_lora_adapter (one adapter, merged),
POST /update_weight_version, POST /pause_generation and /continue_generation (new generations wait between the two;
`--paused` starts the server paused, so an engine restarted in place takes its weights before it generates),
GET /health, GET /model_info,
GET /get_server_info, POST /flush_cache, POST /v1/chat/completions, GET /v1/models. A bad request gets 400 with a
one-line message; an engine failure 500 with a message, never a traceback. Error bodies use SGLang's OpenAI-style shape
`{"object": "error", "message", "type", "param", "code"}`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from grpoflow.embedded.engine.chat import (
    chat_prompt_ids,
    chat_response,
    chat_sampling_params,
)
from grpoflow.embedded.engine.scheduler import (
    GenerationResult,
    InvalidRequest,
    Scheduler,
)
from grpoflow.engine.protocol import (
    BeginWeightUpdateRequest,
    ChatCompletionRequest,
    ContinueGenerationRequest,
    EndWeightUpdateRequest,
    GenerateRequest,
    GenerateResponse,
    InitWeightsUpdateGroupRequest,
    LoadLoRAAdapterRequest,
    LoRAUpdateResponse,
    ModelInfo,
    PauseGenerationRequest,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDiskResponse,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
    WeightsUpdateGroupResponse,
)
from grpoflow.errors import EngineError
from grpoflow.fileio import write_text_atomic
from grpoflow.sockets import bind_socket

log = logging.getLogger(__name__)


def create_app(scheduler: Scheduler, served_model_name: str | None = None, paused: bool = False) -> FastAPI:
    """A FastAPI app serving `scheduler`; the caller owns the scheduler's lifetime. `paused`: generation waits
    for `/continue_generation`."""
    app = FastAPI(title="grpoflow embedded engine", docs_url=None, redoc_url=None)
    app.state.scheduler = scheduler
    app.state.model_name = served_model_name or scheduler.model_path
    app.state.generating = asyncio.Event()  # set: generation requests go ahead; clear: they wait
    if not paused:
        app.state.generating.set()
    _install_error_handlers(app)
    app.include_router(router)
    return app


router = APIRouter()


def _scheduler(request: Request) -> Scheduler:
    return request.app.state.scheduler


def _model_name(request: Request) -> str:
    return request.app.state.model_name


async def _not_held(request: Request) -> None:
    """Wait while generation is paused (SGLang's requests wait on its pause condition alike)."""
    await request.app.state.generating.wait()


Engine = Annotated[Scheduler, Depends(_scheduler)]
ModelName = Annotated[str, Depends(_model_name)]
Generating = Depends(_not_held)


@router.get("/health")
async def health(scheduler: Engine) -> Response:
    return Response(status_code=200 if scheduler.is_alive else 503)


@router.post("/flush_cache")
async def flush_cache(scheduler: Engine) -> Response:
    scheduler.flush_cache()
    return Response("Cache flushed.\n", status_code=200)


@router.get("/model_info")
async def model_info(scheduler: Engine) -> dict:
    hf_config = scheduler.model.config
    return ModelInfo(
        model_path=scheduler.weights_path,  # SGLang's: the last dir loaded (/get_server_info: the launch one)
        tokenizer_path=scheduler.model_path,
        is_generation=True,
        weight_version=scheduler.weight_version,
        model_type=getattr(hf_config, "model_type", None),
        architectures=getattr(hf_config, "architectures", None),
    ).model_dump()


@router.get("/get_server_info")
async def get_server_info(scheduler: Engine, model_name: ModelName) -> dict:
    # SGLang's shape: its server args at the top level, then one `internal_states` entry per scheduler (we
    # have one). The counters are ours (SGLang's entries hold other keys); a benchmark reads busy_time_s
    # twice and divides the difference by its wall time to get the engine's busy fraction.
    return {
        "model_path": scheduler.model_path,
        "tokenizer_path": scheduler.model_path,
        "served_model_name": model_name,
        "random_seed": scheduler.seed,
        "max_running_requests": scheduler.max_batch_size,
        "context_length": scheduler.context_length,
        "weight_version": scheduler.weight_version,
        "tp_size": 1,  # one process: it joins a weight-update group as one worker
        "internal_states": [scheduler.internal_state()],
    }


@router.get("/v1/models")
async def models(scheduler: Engine, model_name: ModelName) -> dict:
    card = {
        "id": model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "grpoflow",
        "root": scheduler.model_path,
        "max_model_len": scheduler.context_length,
    }
    return {"object": "list", "data": [card]}


@router.post("/pause_generation")
async def pause_generation(req: PauseGenerationRequest, request: Request, scheduler: Engine) -> JSONResponse:
    state = scheduler.internal_state()
    if req.mode == "abort" and state["running_requests"] + state["waiting_requests"]:
        return _error(
            400,
            "/pause_generation: mode `abort` with requests in flight is not supported here: use `in_place`",
            "BadRequestError",
        )
    request.app.state.generating.clear()
    return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})


@router.post("/continue_generation")
async def continue_generation(req: ContinueGenerationRequest, request: Request) -> JSONResponse:
    request.app.state.generating.set()
    return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


@router.post("/generate", dependencies=[Generating])
async def generate(req: GenerateRequest, scheduler: Engine) -> dict:
    fut = scheduler.submit(
        req.input_ids, req.sampling_params, return_logprob=req.return_logprob, rid=req.rid, lora_path=req.lora_path
    )
    result: GenerationResult = await asyncio.wrap_future(fut)
    # exclude_none: SGLang leaves out what does not apply (finish_reason.matched on "length", logprobs).
    return _generate_response(result, req.return_logprob).model_dump(exclude_none=True)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(req: UpdateWeightsFromDiskRequest, scheduler: Engine) -> JSONResponse:
    res = await asyncio.wrap_future(scheduler.update_weights_from_disk(req.model_path, req.weight_version))
    body = UpdateWeightsFromDiskResponse(
        success=res.success, message=res.message, num_paused_requests=res.num_paused_requests
    ).model_dump()
    return JSONResponse(body, status_code=200 if res.success else 400)


@router.post("/init_weights_update_group")
async def init_weights_update_group(req: InitWeightsUpdateGroupRequest, scheduler: Engine) -> JSONResponse:
    # Joining blocks until the trainer joins too: off the event loop, so /health and others keep answering.
    await asyncio.get_running_loop().run_in_executor(
        None,
        scheduler.init_weights_update_group,
        req.master_address,
        req.master_port,
        req.rank_offset,
        req.world_size,
        req.group_name,
        req.backend,
    )
    return JSONResponse(WeightsUpdateGroupResponse(success=True, message="joined").model_dump())


@router.post("/begin_weight_update")
async def begin_weight_update(req: BeginWeightUpdateRequest, scheduler: Engine) -> JSONResponse:
    return _update_answer(scheduler.begin_weight_update())


@router.post("/end_weight_update")
async def end_weight_update(req: EndWeightUpdateRequest, scheduler: Engine) -> JSONResponse:
    return _update_answer(scheduler.end_weight_update())


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(req: UpdateWeightsFromDistributedRequest, scheduler: Engine) -> JSONResponse:
    fut = scheduler.update_weights_from_distributed(
        req.names, req.dtypes, req.shapes, req.group_name, req.weight_version
    )
    return _update_answer(await asyncio.wrap_future(fut))


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(req: UpdateWeightsFromTensorRequest, scheduler: Engine) -> JSONResponse:
    fut = scheduler.update_weights_from_tensor(req.serialized_named_tensors, req.load_format, req.weight_version)
    return _update_answer(await asyncio.wrap_future(fut))


@router.post("/load_lora_adapter")
async def load_lora_adapter(req: LoadLoRAAdapterRequest, scheduler: Engine) -> JSONResponse:
    return _lora_answer(await asyncio.wrap_future(scheduler.load_lora_adapter(req.lora_name, req.lora_path)))


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(req: UnloadLoRAAdapterRequest, scheduler: Engine) -> JSONResponse:
    return _lora_answer(await asyncio.wrap_future(scheduler.unload_lora_adapter(req.lora_name)))


@router.post("/update_weight_version")
async def update_weight_version(req: UpdateWeightVersionRequest, scheduler: Engine) -> JSONResponse:
    res = await asyncio.wrap_future(scheduler.update_weight_version(req.new_version))
    return JSONResponse({"success": res.success, "message": res.message})


@router.post("/v1/chat/completions", dependencies=[Generating])
async def chat_completions(req: ChatCompletionRequest, scheduler: Engine, model_name: ModelName) -> dict:
    prompt_ids = chat_prompt_ids(scheduler.tokenizer, req)
    futs = [
        scheduler.submit(
            prompt_ids,
            chat_sampling_params(req, len(prompt_ids), scheduler.context_length, i),
            return_logprob=bool(req.logprobs),
        )
        for i in range(req.n)
    ]
    results = [await asyncio.wrap_future(f) for f in futs]
    return chat_response(scheduler.tokenizer, req, model_name, prompt_ids, results)


def _update_answer(res) -> JSONResponse:
    """A weight update's answer in SGLang's shape: 400 when it failed."""
    body = WeightsUpdateGroupResponse(success=res.success, message=res.message).model_dump()
    return JSONResponse(body, status_code=200 if res.success else 400)


def _lora_answer(res) -> JSONResponse:
    body = LoRAUpdateResponse(success=res.success, error_message=None if res.success else res.message)
    return JSONResponse(body.model_dump(), status_code=200 if res.success else 400)


def _generate_response(r: GenerationResult, return_logprob: bool) -> GenerateResponse:
    meta = {
        "id": r.rid,
        "finish_reason": r.finish_reason,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": len(r.output_ids),
        "weight_version": r.weight_version,
    }
    if return_logprob:
        # SGLang sends the token text as null unless return_text_in_logprobs.
        meta["output_token_logprobs"] = [
            (lp, tok, None) for lp, tok in zip(r.output_logprobs, r.output_ids, strict=True)
        ]
    return GenerateResponse.model_validate({"text": r.text, "output_ids": r.output_ids, "meta_info": meta})


def _error(status: int, message: str, kind: str) -> JSONResponse:
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return JSONResponse(body, status_code=status)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        parts = []
        for err in errors[:3]:
            loc = [p for p in err.get("loc", ()) if p != "body"]
            if err.get("type") == "json_invalid":
                parts.append(f"body is not valid JSON (at character {loc[0] if loc else '?'})")
            elif not loc and err.get("type") == "model_attributes_type":
                parts.append("body must be a JSON object (send Content-Type: application/json)")
            else:
                parts.append(f"{'.'.join(str(p) for p in loc) or 'body'}: {err.get('msg')}")
        more = f" (+{len(errors) - 3} more)" if len(errors) > 3 else ""
        return _error(400, f"{request.url.path}: " + "; ".join(parts) + more, "BadRequestError")

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: Request, exc: InvalidRequest) -> JSONResponse:
        return _error(400, f"{request.url.path}: {exc}", "BadRequestError")

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError) -> JSONResponse:
        return _error(500, f"{request.url.path}: {exc}", "InternalServerError")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return _error(500, f"{request.url.path}: {type(exc).__name__}: {exc}", "InternalServerError")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m grpoflow.embedded.engine.server", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="Hugging Face model folder (config.json, safetensors).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = a free port, reported via --port-file and stdout.")
    p.add_argument("--seed", type=int, default=0, help="Engine seed for requests without sampling_seed.")
    # One thread by default: the engine shares a small, noisy CPU with the trainer and sandboxes, and with two
    # threads every matmul waits for the slower core, so throughput collapses under contention.
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1).")
    p.add_argument("--max-batch-size", type=int, default=16, help="Most requests decoded together.")
    p.add_argument("--prefix-cache-tokens", type=int, default=16384, help="KV kept for prompt reuse; 0 = off.")
    p.add_argument("--port-file", type=Path, default=None, help="Write the bound port here (atomically).")
    p.add_argument("--served-model-name", default=None, help="Model id for /v1 endpoints (default: model path).")
    p.add_argument(
        "--no-pack-weights", action="store_true", help="Plain F.linear (MKL) instead of oneDNN-packed linears."
    )
    p.add_argument("--paused", action="store_true", help="Start with generation paused (/continue_generation).")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import uvicorn
    from transformers.utils import logging as hf_logging

    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    hf_logging.disable_progress_bar()
    if not Path(args.model_path).is_dir():
        sys.exit(f"grpoflow-engine: model path {args.model_path} does not exist or is not a directory")
    scheduler = Scheduler(
        args.model_path,
        seed=args.seed,
        threads=args.threads,
        max_batch_size=args.max_batch_size,
        prefix_cache_tokens=args.prefix_cache_tokens,
        pack_weights=not args.no_pack_weights,
    )
    sock = bind_socket(args.host, args.port)
    port = sock.getsockname()[1]
    if args.port_file is not None:
        write_text_atomic(args.port_file, f"{port}\n")
    print(f"grpoflow-engine listening on http://{args.host}:{port}", flush=True)
    config = uvicorn.Config(
        create_app(scheduler, args.served_model_name, paused=args.paused),
        log_level=args.log_level,
        access_log=False,
        timeout_keep_alive=30,
    )
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        scheduler.close()
        sock.close()


if __name__ == "__main__":
    main()
