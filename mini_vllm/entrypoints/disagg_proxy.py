"""Disaggregated serving: a proxy in front of a prefill server and a decode server.

Plays the role of upstream's toy proxy
(tests/v1/kv_connector/nixl_integration/toy_proxy_server.py at v0.22.1, read
for behaviour, and examples/online_serving/disaggregated_serving/): each
``/v1/completions`` or ``/v1/chat/completions`` request goes first to a
prefill server with ``max_tokens=1`` (and ``max_completion_tokens=1`` when
the request sets it), ``stream=False`` and ``kv_transfer_params =
{"do_remote_decode": True}``; the ``kv_transfer_params`` in its answer (where
the prefill engine holds the prompt's KV) go with the original request to a
decode server, whose answer is passed back to the client as it comes (a
stream stays a stream). Prefill and decode servers are taken in turn when
there are several.

``python -m mini_vllm.entrypoints.disagg_proxy --prefiller-port 8100
--decoder-port 8200 --port 8000`` runs the proxy alone, with upstream's
flags. ``--launch`` (``make disagg``) also starts the pair: two
``mini-vllm serve`` processes whose ``--kv-transfer-config`` names the
ZmqConnector (mini_vllm/distributed/kv_transfer/kv_connector/v1/zmq_connector.py),
each with its own side-channel port, and stops them on exit.

Left out: the request id header, API keys, health checks
of the backends, retries (a prefill error is returned to the client as is).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def build_app(prefill_urls: list[str], decode_urls: list[str]) -> FastAPI:
    """The proxy over these servers (``http://host:port`` each)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.prefill = [httpx.AsyncClient(base_url=u, timeout=None) for u in prefill_urls]
        app.state.decode = [httpx.AsyncClient(base_url=u, timeout=None) for u in decode_urls]
        app.state.next_prefill = itertools.cycle(app.state.prefill)
        app.state.next_decode = itertools.cycle(app.state.decode)
        yield
        for client in app.state.prefill + app.state.decode:
            await client.aclose()

    app = FastAPI(lifespan=lifespan)
    # Requests handed over and the prefill blocks they named (benchmarks read it).
    app.state.stats = {"requests": 0, "remote_blocks": 0}

    async def handle(api: str, raw_request: Request):
        req_data = await raw_request.json()
        # 1. Prefill: one token, no stream, and keep the KV for a decoder.
        prefill_data = {
            **req_data,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        }
        if "max_completion_tokens" in req_data:
            prefill_data["max_completion_tokens"] = 1
        for name in ("stream_options", "min_tokens", "min_completion_tokens"):
            prefill_data.pop(name, None)
        prefill = await next(app.state.next_prefill).post(api, json=prefill_data)
        if prefill.status_code != 200:
            return Response(prefill.content, prefill.status_code, media_type="application/json")
        # 2. Decode: the original request, told where the prompt's KV is.
        kv_transfer_params = prefill.json().get("kv_transfer_params")
        decode_data = dict(req_data)
        if kv_transfer_params:
            decode_data["kv_transfer_params"] = kv_transfer_params
            app.state.stats["requests"] += 1
            app.state.stats["remote_blocks"] += len(
                kv_transfer_params.get("remote_block_ids") or ()
            )
        client = next(app.state.next_decode)
        if not req_data.get("stream"):
            decode = await client.post(api, json=decode_data)
            return JSONResponse(decode.json(), decode.status_code)

        async def stream():
            async with client.stream("POST", api, json=decode_data) as response:
                async for chunk in response.aiter_bytes():
                    yield chunk

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(raw_request: Request):
        return await handle("/v1/completions", raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw_request: Request):
        return await handle("/v1/chat/completions", raw_request)

    return app


def kv_transfer_config(side_channel_port: int, policy: str = "recompute", **extra) -> dict:
    """The ``--kv-transfer-config`` of one server of the pair; ``extra``: more
    ``kv_connector_extra_config`` keys (zmq_connector.py lists them)."""
    return {
        "kv_connector": "ZmqConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {
            "side_channel_host": "127.0.0.1",
            "side_channel_port": side_channel_port,
            **extra,
        },
    }


def server_command(
    port: int, side_channel_port: int, *serve_args: str, policy: str = "recompute", **extra
) -> list[str]:
    """``mini-vllm serve`` with the ZmqConnector on ``side_channel_port``."""
    config = json.dumps(kv_transfer_config(side_channel_port, policy, **extra))
    return [
        sys.executable,
        "-m",
        "mini_vllm",
        "serve",
        "--port",
        str(port),
        "--kv-transfer-config",
        config,
        *serve_args,
    ]


def wait_until_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server for {url} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server for {url} did not start in {timeout:.0f}s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m mini_vllm.entrypoints.disagg_proxy",
        description="Proxy (chat) completions to a prefill server, then a decode server.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefiller-host", default="127.0.0.1")
    p.add_argument("--prefiller-ports", "--prefiller-port", type=int, nargs="+", default=[8100])
    p.add_argument("--decoder-host", default="127.0.0.1")
    p.add_argument("--decoder-ports", "--decoder-port", type=int, nargs="+", default=[8200])
    p.add_argument(
        "--launch",
        action="store_true",
        help="also start one prefill and one decode server (mini-vllm serve) on the first "
        "ports, side channels on port + 1000; arguments after -- go to both",
    )
    argv = sys.argv[1:] if argv is None else argv
    serve_args: list[str] = []
    if "--" in argv:
        serve_args = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    args = p.parse_args(argv)
    args.serve_args = serve_args
    return args


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = parse_args(argv)
    prefill_urls = [f"http://{args.prefiller_host}:{p}" for p in args.prefiller_ports]
    decode_urls = [f"http://{args.decoder_host}:{p}" for p in args.decoder_ports]
    procs: list[subprocess.Popen] = []
    try:
        if args.launch:
            for port, _url in (
                (args.prefiller_ports[0], prefill_urls[0]),
                (args.decoder_ports[0], decode_urls[0]),
            ):
                cmd = server_command(port, port + 1000, *args.serve_args)
                procs.append(subprocess.Popen(cmd, env=os.environ.copy()))
            for proc, url in zip(procs, (prefill_urls[0], decode_urls[0]), strict=True):
                wait_until_healthy(url, proc)
            print(f"prefill {prefill_urls[0]}, decode {decode_urls[0]}", file=sys.stderr)
        uvicorn.run(build_app(prefill_urls, decode_urls), host=args.host, port=args.port)
    except KeyboardInterrupt:
        return 130
    except RuntimeError as e:
        print(f"disagg_proxy: error: {e}", file=sys.stderr)
        return 1
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
