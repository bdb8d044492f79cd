"""The OpenAI-compatible HTTP server: FastAPI routes over one ``AsyncLLM``.

Mirrors upstream ``vllm/entrypoints/openai/api_server.py`` (``build_app`` :157,
``init_app_state`` :310, ``run_server`` :665) at v0.22.1, with its routes
(``create_completion`` (vllm/entrypoints/openai/completion/api_router.py:46),
``create_chat_completion`` (vllm/entrypoints/openai/chat_completion/api_router.py:53),
``show_available_models`` (vllm/entrypoints/openai/models/api_router.py:21),
``health`` (vllm/entrypoints/serve/instrumentator/health.py:23)), its exception
handlers (``validation_exception_handler``
(vllm/entrypoints/openai/server_utils.py:409) and the two before it) and
``with_cancellation`` (vllm/entrypoints/utils.py:57).

Errors are the OpenAI JSON ``{"error": {"message", "type", "param", "code"}}``
with the status in ``code``: a body that is not JSON or does not fit the
request model is a 400 (FastAPI's RequestValidationError, as upstream turns
it, with ``param`` from a validator's ``VLLMValidationError``), an unknown
model a 404, bad or unsupported values a 400, anything else a 500; the server
goes on serving. Errors the framework raises itself (a body that is not
UTF-8, an unknown route 404, a wrong method 405 with its ``Allow`` header) are
Starlette's ``HTTPException``; upstream's handler is registered for FastAPI's
subclass (vllm/entrypoints/openai/api_server.py:257), so they miss it and
clients get ``{"detail": ...}`` there. mini_vllm gives them the same JSON.
``/metrics`` is the Prometheus text of ``mini_vllm/metrics/loggers.py``.

LoRA: ``--enable-lora --lora-modules name=path ...`` serves each PEFT adapter
under its name, as upstream's flag (``LoRAParserAction``
(vllm/entrypoints/openai/cli_args.py:35), ``name=path`` form only): the
adapters are read at start-up, a bad one stops the server with one line
(``OpenAIServingModels.init_static_loras``
(vllm/entrypoints/openai/models/serving.py:117)), ids count from 1 in the
given order, and ``/v1/models`` lists them after the base model, each with
its path as ``root`` and the base model as ``parent``
(``OpenAIServingModels.show_available_models``
(vllm/entrypoints/openai/models/serving.py:142)).

KV connectors: ``--kv-transfer-config '{"kv_connector": ..., "kv_role": ...}'``,
upstream's flag, a JSON of KVTransferConfig's fields; a request's
``kv_transfer_params`` reach the connector and the prefill engine's answer
carries them back (disaggregated serving: mini_vllm/entrypoints/disagg_proxy.py).

Speculative decoding: ``--speculative-config '{"method": "ngram",
"num_speculative_tokens": 3}'``, upstream's flag (``-sc``), a JSON of
SpeculativeConfig's fields; n-gram is the only method, and a bad JSON or key
stops the server with one line before the model loads.

Shutdown: Ctrl-C (SIGINT) or SIGTERM lets uvicorn finish the open requests;
then the app's ``lifespan`` stops the AsyncLLM's engine-core thread while the
event loop still runs, aborting whatever the engine core still holds, as
upstream shuts its engine client down before the loop ends
(``build_async_engine_client_from_engine_args``
(vllm/entrypoints/openai/api_server.py:109) in its ``finally``, and
``serve_http`` (vllm/entrypoints/launcher.py:26) in its ``handle_shutdown``
(vllm/entrypoints/launcher.py:106)).

Left out: API keys, CORS, loading or unloading adapters at run time,
tokenization/embedding/score/audio routes,
multiple API server processes, SageMaker routes, the request logger.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from mini_vllm.engine.async_llm import AsyncLLM, EngineGenerateError
from mini_vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    VLLMValidationError,
)
from mini_vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from mini_vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from mini_vllm.entrypoints.openai.serving_engine import create_error_response
from mini_vllm.lora.request import LoRARequest


async def listen_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def with_cancellation(handler_func):
    """Cancel a handler whose client disconnected before it answered (its
    generate() then aborts the request). A streaming response watches for the
    disconnect itself once it has started."""

    @functools.wraps(handler_func)
    async def wrapper(request, raw_request: Request):
        handler_task = asyncio.create_task(handler_func(request, raw_request))
        cancellation_task = asyncio.create_task(listen_for_disconnect(raw_request))
        done, pending = await asyncio.wait(
            [handler_task, cancellation_task], return_when=asyncio.FIRST_COMPLETED
        )
        for task in pending:
            task.cancel()
        if handler_task in done:
            return handler_task.result()
        return None

    return wrapper


def _respond(result):
    """A handler's result as an HTTP response: error JSON, JSON, or an SSE stream."""
    if isinstance(result, ErrorResponse):
        return JSONResponse(result.model_dump(), status_code=result.error.code)
    if hasattr(result, "model_dump"):
        return JSONResponse(result.model_dump())
    return StreamingResponse(result, media_type="text/event-stream")


@with_cancellation
async def create_completion(request: CompletionRequest, raw_request: Request):
    handler: OpenAIServingCompletion = raw_request.app.state.openai_serving_completion
    return _respond(await handler.create_completion(request))


@with_cancellation
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
    handler: OpenAIServingChat = raw_request.app.state.openai_serving_chat
    return _respond(await handler.create_chat_completion(request))


async def show_available_models(raw_request: Request) -> JSONResponse:
    state = raw_request.app.state
    max_model_len = state.engine_client.vllm_config.model_config.max_model_len
    models = ModelList(
        data=[
            ModelCard(id=name, root=state.args.model, max_model_len=max_model_len)
            for name in state.served_model_names
        ]
    )
    models.data += [
        ModelCard(id=lora.lora_name, root=lora.lora_path, parent=lora.base_model_name)
        for lora in state.lora_requests.values()
    ]
    return JSONResponse(models.model_dump())


async def health(raw_request: Request) -> Response:
    healthy = raw_request.app.state.engine_client.check_health()
    return Response(status_code=200 if healthy else 503)


async def metrics(raw_request: Request) -> Response:
    logger = raw_request.app.state.engine_client.stat_logger
    return Response(logger.render(), media_type=CONTENT_TYPE_LATEST)


async def http_exception_handler(req: Request, exc: HTTPException) -> JSONResponse:
    err = ErrorResponse(
        error=ErrorInfo(
            message=str(exc.detail), type=HTTPStatus(exc.status_code).phrase, code=exc.status_code
        )
    )
    return JSONResponse(err.model_dump(), status_code=exc.status_code, headers=exc.headers)


async def validation_exception_handler(req: Request, exc: RequestValidationError) -> JSONResponse:
    # A validator that raised VLLMValidationError names the field.
    param = next(
        (
            e["ctx"]["error"].parameter
            for e in exc.errors()
            if isinstance(e.get("ctx", {}).get("error"), VLLMValidationError)
        ),
        None,
    )
    exc_str, errors_str = str(exc), str(exc.errors())
    message = f"{exc_str} {errors_str}" if exc.errors() and errors_str != exc_str else exc_str
    err = ErrorResponse(
        error=ErrorInfo(
            message=message,
            type=HTTPStatus.BAD_REQUEST.phrase,
            code=HTTPStatus.BAD_REQUEST,
            param=param,
        )
    )
    return JSONResponse(err.model_dump(), status_code=HTTPStatus.BAD_REQUEST)


async def exception_handler(req: Request, exc: Exception) -> JSONResponse:
    err = create_error_response(exc)
    return JSONResponse(err.model_dump(), status_code=err.error.code)


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    """Serve; on the way out, stop the engine-core thread before the event loop
    closes (it hands each step's outputs to this loop)."""
    try:
        yield
    finally:
        if (engine_client := getattr(app.state, "engine_client", None)) is not None:
            engine_client.shutdown()


def build_app(args: argparse.Namespace) -> FastAPI:
    app = FastAPI(lifespan=lifespan)
    app.state.args = args
    app.post("/v1/completions")(create_completion)
    app.post("/v1/chat/completions")(create_chat_completion)
    app.get("/v1/models")(show_available_models)
    app.get("/health", response_class=Response)(health)
    app.get("/metrics", response_class=Response)(metrics)
    app.exception_handler(HTTPException)(http_exception_handler)
    app.exception_handler(RequestValidationError)(validation_exception_handler)
    # A handler for a named class answers and is done; the one for Exception
    # answers, then Starlette re-raises (uvicorn logs it and drops the connection).
    app.exception_handler(EngineGenerateError)(exception_handler)
    app.exception_handler(Exception)(exception_handler)
    return app


def init_static_loras(engine_client: AsyncLLM, args: argparse.Namespace, base_model_name: str):
    """The ``--lora-modules`` adapters as LoRARequests by name, each read now
    (ValueError, one line, for a bad one)."""
    lora_requests = {}
    for lora_int_id, module in enumerate(getattr(args, "lora_modules", None) or [], start=1):
        lora = LoRARequest(module.name, lora_int_id, module.path, base_model_name)
        engine_client.llm_engine._check_adapter(lora)
        lora_requests[module.name] = lora
    return lora_requests


def init_app_state(engine_client: AsyncLLM, state, args: argparse.Namespace) -> None:
    served_model_names = args.served_model_name or [args.model]
    state.engine_client = engine_client
    state.args = args
    state.served_model_names = served_model_names
    state.lora_requests = init_static_loras(engine_client, args, served_model_names[0])
    # One thread prepares every request (tokenizing, off the event loop).
    state.executor = executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="serve")
    state.openai_serving_completion = OpenAIServingCompletion(
        engine_client, served_model_names, executor, state.lora_requests
    )
    state.openai_serving_chat = OpenAIServingChat(
        engine_client, served_model_names, executor, state.lora_requests
    )


@dataclasses.dataclass
class LoRAModulePath:
    """One ``--lora-modules`` item (upstream: vllm/entrypoints/openai/models/protocol.py)."""

    name: str
    path: str


def parse_lora_module(item: str) -> LoRAModulePath:
    name, sep, path = item.partition("=")
    if not sep or not name or not path or "=" in path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {item!r}")
    return LoRAModulePath(name, path)


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``mini-vllm serve``'s arguments (upstream: vllm/entrypoints/openai/cli_args.py:340)."""
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a model folder or .gguf file; default: the SmolLM2-135M-Instruct GGUF",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model name(s) clients use (default: the model path)",
    )
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", "-q", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-loras", type=int, default=1)
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=None,
        help="name=path: serve the PEFT adapter in folder path as model name (needs --enable-lora)",
    )
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "cpu", "torch", "triton"],
        help="auto: triton on CUDA, cpu (batched torch) on CPU; torch: the readable reference",
    )
    parser.add_argument(
        "--kv-transfer-config",
        type=parse_kv_transfer_config,
        default=None,
        help='a KV connector, as JSON: {"kv_connector": "ZmqConnector", "kv_role": '
        '"kv_both", ...} (Phase 15; upstream\'s flag of the same name)',
    )
    parser.add_argument(
        "--speculative-config",
        "-sc",
        default=None,
        help='speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_max": 5, "prompt_lookup_min": 2} (Phase 08; upstream\'s flag)',
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model over this many worker processes (tensor parallelism)",
    )
    parser.add_argument(
        "--distributed-executor-backend", default=None, choices=["uni", "mp", "ray"]
    )
    return parser


def parse_speculative_config(text: str | None) -> dict | None:
    """``--speculative-config``'s JSON (upstream reads it with ``json.loads``,
    "" and "None" meaning none: vllm/engine/arg_utils.py:1458,
    vllm/engine/arg_utils.py:153), checked as ``LLM(speculative_config=...)``
    checks it; a bad one is a ValueError in one line naming the flag."""
    from mini_vllm.config import SpeculativeConfig

    if text is None or text in ("", "None"):
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not JSON ({e}): {text!r}") from e
    try:
        SpeculativeConfig.from_dict(config)
    except (ValueError, TypeError) as e:
        raise ValueError(f"--speculative-config: {e}") from e
    return config


def parse_kv_transfer_config(text: str) -> dict:
    """``--kv-transfer-config``'s JSON, checked as KVTransferConfig checks it."""
    from mini_vllm.config import KVTransferConfig

    try:
        config = json.loads(text)
        KVTransferConfig.from_dict(config)
    except (json.JSONDecodeError, ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return config


def build_async_engine_client(args: argparse.Namespace) -> AsyncLLM:
    """Load the model named by ``args`` into an AsyncLLM."""
    from mini_vllm.model_executor.model_loader import smollm2_gguf_path

    if args.model is None:
        args.model = str(smollm2_gguf_path())
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora.")
    speculative_config = parse_speculative_config(getattr(args, "speculative_config", None))
    served = args.served_model_name or [args.model]
    return AsyncLLM.from_model(
        args.model,
        model_name=served[0],
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        enable_prefix_caching=not args.no_prefix_caching,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        kv_transfer_config=getattr(args, "kv_transfer_config", None),
        speculative_config=speculative_config,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        distributed_executor_backend=getattr(args, "distributed_executor_backend", None),
    )


def run_server(args: argparse.Namespace, engine_client: AsyncLLM | None = None) -> None:
    """Serve until interrupted (Ctrl-C)."""
    import uvicorn

    if engine_client is None:
        engine_client = build_async_engine_client(args)
    app = build_app(args)
    init_app_state(engine_client, app.state, args)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        app.state.executor.shutdown(wait=False)
        engine_client.shutdown()


class ServerThread:
    """A server in a thread of this process on 127.0.0.1, on a port the kernel
    picks (bound to port 0, so parallel runs never collide): for tests,
    benchmarks and labs. ``stop`` ends it and the AsyncLLM's engine-core thread."""

    def __init__(
        self,
        engine: AsyncLLM,
        model_path: str,
        served_model_name: str,
        lora_modules: list[LoRAModulePath] | None = None,
    ) -> None:
        import uvicorn

        self.engine = engine
        args = argparse.Namespace(
            model=model_path, served_model_name=[served_model_name], lora_modules=lora_modules
        )
        app = build_app(args)
        init_app_state(engine, app.state, args)
        self.executor = app.state.executor
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server thread did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.executor.shutdown(wait=False)
        self.engine.shutdown()
        self.sock.close()
