"""A network KV connector: the decode engine pulls a prefill engine's KV over ZeroMQ.

Mirrors upstream ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/connector.py``
at v0.22.1 (``NixlConnector`` :57, ``NixlConnectorScheduler`` (scheduler.py:51),
``NixlConnectorWorker`` (worker.py:86), ``NixlConnectorMetadata``
(metadata.py:165)): the same flow and names, with pyzmq sockets where
upstream has NIXL agents. The flow, driven by each request's
``kv_transfer_params`` (a proxy sets them):

1. Prefill engine, ``{"do_remote_decode": True}`` and ``max_tokens=1``: it
   prefills, samples one token and finishes. ``request_finished`` returns
   True (the scheduler keeps the blocks) and the parameters the decode side
   needs: ``do_remote_prefill``, ``remote_engine_id``, ``remote_request_id``,
   ``remote_host``, ``remote_port``, ``remote_block_ids``,
   ``remote_num_tokens``, as ``request_finished`` (scheduler.py:580) does.
   Its worker serves reads of those blocks on ``side_channel_host:side_channel_port``; a read, or
   ``kv_lease_duration`` seconds without one (upstream's lease,
   scheduler.py:70, worker.py:1771-1787), puts the request in
   ``finished_sending`` and the scheduler frees the blocks.
2. Decode engine, the returned parameters: ``get_num_new_matched_tokens``
   says the prompt's tokens load asynchronously (scheduler.py:356), so the
   request waits in WAITING_FOR_REMOTE_KVS with its blocks allocated;
   ``update_state_after_alloc`` notes which local blocks to fill
   (scheduler.py:434); the worker reads the remote blocks on a background
   thread (worker.py:1933), writes them into the paged cache in
   ``get_finished`` and reports the request in ``finished_recving``; the
   scheduler then runs it from its last prompt token.
3. A read that fails (the peer died, the lease expired, a bad reply) marks
   the request's local blocks in ``get_block_ids_with_load_errors`` and still
   reports it in ``finished_recving``, as ``_handle_failed_transfer``
   (worker.py:1915) does: the scheduler recomputes or fails that request
   alone, by ``kv_load_failure_policy``.

Extra config keys (``kv_connector_extra_config``): ``side_channel_host``
(default ``localhost``), ``side_channel_port`` (default 5600, upstream's
``VLLM_NIXL_SIDE_CHANNEL_PORT`` default), ``kv_lease_duration`` (seconds,
default 30, upstream's), ``kv_read_timeout`` (seconds a decode read may
take, default 10; mini's own: NIXL reports a dead transfer itself).

Left out: RDMA and NIXL agents (the bytes are copied through the CPU and a
TCP socket), the handshake and its compatibility hash (both engines must run
the same model, block size and dtype), heterogeneous TP and block-size
mapping, hybrid (HMA), Mamba and MLA layouts, host buffers, heartbeats that
extend the lease while a request queues on the decode side, bidirectional
transfers, async-scheduling bookkeeping (``reqs_in_batch``,
``reqs_not_processed``) and stats.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import zmq

from mini_vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from mini_vllm.config import VllmConfig
    from mini_vllm.core.kv_cache_manager import KVCacheBlocks
    from mini_vllm.core.sched.output import SchedulerOutput
    from mini_vllm.kv_cache_interface import KVCacheConfig
    from mini_vllm.request import Request

logger = logging.getLogger(__name__)

ReqId = str
REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


@dataclass
class RemoteMeta:
    block_ids: list[int]
    host: str
    port: int
    engine_id: str
    request_id: str


@dataclass
class ReqMeta:
    # The local blocks the remote KV goes into (empty: nothing to read, only
    # tell the prefill side it may free its blocks).
    local_block_ids: list[int]
    remote: RemoteMeta


@dataclass
class ZmqConnectorMetadata(KVConnectorMetadata):
    # Decode side: reads to start this step.
    reqs_to_recv: dict[ReqId, ReqMeta] = field(default_factory=dict)
    # Prefill side: finished requests whose blocks wait for a reader, with
    # the time (time.perf_counter()) their lease ends.
    reqs_to_send: dict[ReqId, float] = field(default_factory=dict)

    def add_new_req_to_recv(
        self, request_id: ReqId, local_block_ids: list[int], kv_transfer_params: dict[str, Any]
    ) -> None:
        self.reqs_to_recv[request_id] = ReqMeta(
            local_block_ids=local_block_ids,
            remote=RemoteMeta(
                block_ids=list(kv_transfer_params["remote_block_ids"]),
                host=kv_transfer_params["remote_host"],
                port=int(kv_transfer_params["remote_port"]),
                engine_id=kv_transfer_params["remote_engine_id"],
                request_id=kv_transfer_params["remote_request_id"],
            ),
        )


class ZmqConnector(KVConnectorBase_V1):
    """One object, two halves, as upstream's NixlConnector: the role picks
    which half is built and every call goes to it."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        engine_id = self._kv_transfer_config.engine_id
        self.connector_scheduler: ZmqConnectorScheduler | None = None
        self.connector_worker: ZmqConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = ZmqConnectorScheduler(vllm_config, engine_id)
        else:
            self.connector_worker = ZmqConnectorWorker(vllm_config, engine_id)

    # --------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.connector_worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ZmqConnectorMetadata)
        self.connector_worker.start_load_kv(metadata, idle=forward_context.attn_metadata is None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request and asynchronous, never per layer

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return  # the KV stays in the paged cache until the reader comes

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        assert self.connector_worker is not None
        return self.connector_worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.connector_worker is not None
        return self.connector_worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()


class ZmqConnectorScheduler:
    """The scheduler half: decides, from ``kv_transfer_params``, what each
    request reads or keeps for a reader."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str) -> None:
        config = vllm_config.kv_transfer_config
        assert config is not None
        self.engine_id = engine_id
        self.block_size = vllm_config.cache_config.block_size
        self.side_channel_host = config.get_from_extra_config("side_channel_host", "localhost")
        self.side_channel_port = int(config.get_from_extra_config("side_channel_port", 5600))
        self._kv_lease_duration = float(config.get_from_extra_config("kv_lease_duration", 30))
        # Decode side: requests given blocks to read into, this step.
        self._reqs_need_recv: dict[ReqId, tuple[Request, list[int]]] = {}
        # Prefill side: finished requests held for a reader, with their deadline.
        self._reqs_need_send: dict[ReqId, float] = {}

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """A decode-side request reads every prompt token the local prefix
        cache does not hold, asynchronously."""
        params = request.kv_transfer_params
        if params is not None and params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        if params.get("remote_block_ids") and all(k in params for k in REMOTE_KEYS):
            # The blocks past the local prefix hit; none on a full local hit
            # (the read is then only a notice that the prefill side may free).
            local_block_ids: list[int] = []
            if num_external_tokens > 0:
                (all_block_ids,) = blocks.get_block_ids()
                num_local_hit = len(request.prompt_token_ids) - num_external_tokens
                local_block_ids = all_block_ids[num_local_hit // self.block_size :]
            self._reqs_need_recv[request.request_id] = (request, local_block_ids)
        else:
            logger.warning("Invalid kv_transfer_params %s: no KV transfer for it.", params)
        # One transfer per request.
        params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ZmqConnectorMetadata:
        meta = ZmqConnectorMetadata()
        for req_id, (request, block_ids) in self._reqs_need_recv.items():
            meta.add_new_req_to_recv(req_id, block_ids, request.kv_transfer_params)
        meta.reqs_to_send = self._reqs_need_send
        self._reqs_need_recv = {}
        self._reqs_need_send = {}
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """A prefill-side request that finished normally keeps its blocks for
        the decode side and returns where to read them."""
        from mini_vllm.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Aborted before it was scheduled: tell the prefill side to free.
            self._reqs_need_recv[request.request_id] = (request, [])
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode"):
            return False, None  # a decode-side request
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            return False, None  # aborted or failed: nobody will read it
        delay_free_blocks = len(block_ids) > 0
        if delay_free_blocks:
            self._reqs_need_send[request.request_id] = time.perf_counter() + self._kv_lease_duration
        return delay_free_blocks, dict(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_block_ids=list(block_ids),
            remote_engine_id=self.engine_id,
            remote_request_id=request.request_id,
            remote_host=self.side_channel_host,
            remote_port=self.side_channel_port,
            tp_size=1,
            remote_num_tokens=request.num_computed_tokens,
        )


class ZmqConnectorWorker:
    """The worker half: on the prefill side a thread answers reads of held
    blocks; on the decode side a thread reads and the step writes the KV in."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str) -> None:
        config = vllm_config.kv_transfer_config
        assert config is not None
        self.engine_id = engine_id
        self.side_channel_host = config.get_from_extra_config("side_channel_host", "localhost")
        self.side_channel_port = int(config.get_from_extra_config("side_channel_port", 5600))
        self.kv_read_timeout = float(config.get_from_extra_config("kv_read_timeout", 10))
        self.serves = config.kv_role in ("kv_producer", "kv_both")
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        # Prefill side: held requests and their lease's end (read by the server thread).
        self._reqs_to_send: dict[ReqId, float] = {}
        self._done_sending: queue.SimpleQueue[ReqId] = queue.SimpleQueue()
        # Decode side: reads in flight, and what came back (payload None: failed).
        self._recving_metadata: dict[ReqId, ReqMeta] = {}
        self._done_recving: queue.Queue[tuple[ReqId, torch.Tensor | None]] = queue.Queue()
        self._invalid_block_ids: set[int] = set()
        self._idle = False
        self._ctx = zmq.Context()
        self._reader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-read")
        self._stop = threading.Event()
        self._server: threading.Thread | None = None
        # Bytes moved, for the benchmark.
        self.bytes_sent = 0
        self.bytes_recv = 0

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Layer name -> its paged KV, ``[num_blocks, 2, block_size, heads, head_size]``."""
        self.kv_caches = dict(kv_caches)
        if self.serves and self._server is None:
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"tcp://{self.side_channel_host}:{self.side_channel_port}")
            self._server = threading.Thread(
                target=self._serve, args=(sock,), name="kv-side-channel", daemon=True
            )
            self._server.start()

    # ------------------------------------------------------------ prefill side

    def _serve(self, sock: zmq.Socket) -> None:
        """Answer each read of a held request's blocks with their KV, all
        layers at once; a read of an unknown (not yet held, or expired)
        request gets ``unknown`` and the reader may retry."""
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            identity, _, body = sock.recv_multipart()
            msg = json.loads(body)
            req_id, block_ids = msg["request_id"], msg["block_ids"]
            with self._lock:
                held = self._reqs_to_send.pop(req_id, None) is not None
            if not held:
                sock.send_multipart([identity, b"", json.dumps({"status": "unknown"}).encode()])
                continue
            kv = torch.stack([cache[block_ids] for cache in self.kv_caches.values()])
            payload = kv.contiguous().numpy().tobytes()
            header = {"status": "ok", "shape": list(kv.shape), "dtype": str(kv.dtype)}
            sock.send_multipart([identity, b"", json.dumps(header).encode(), payload])
            self.bytes_sent += len(payload)
            self._done_sending.put(req_id)

    # ------------------------------------------------------------- decode side

    def _read_blocks(self, req_id: ReqId, meta: ReqMeta) -> None:
        """On a reader thread: fetch the remote blocks (retrying while the
        prefill side has not registered the request yet), then hand the KV
        to the step thread; None when the read failed."""
        remote = meta.remote
        # Only the remote blocks past our local prefix hit (worker.py:2106 on).
        n = len(meta.local_block_ids)
        remote_block_ids = remote.block_ids[-n:] if n else []
        deadline = time.monotonic() + self.kv_read_timeout
        msg = json.dumps({"request_id": remote.request_id, "block_ids": remote_block_ids})
        result: torch.Tensor | None = None
        try:
            while time.monotonic() < deadline:
                reply = self._request(remote, msg.encode(), deadline)
                if reply is None:
                    break  # timed out: the peer is gone
                header = json.loads(reply[0])
                if header["status"] == "ok":
                    dtype = getattr(torch, header["dtype"].removeprefix("torch."))
                    result = torch.frombuffer(bytearray(reply[1]), dtype=dtype).reshape(
                        header["shape"]
                    )
                    self.bytes_recv += len(reply[1])
                    break
                time.sleep(0.01)  # not held there yet: ask again
        except Exception as e:  # a bad reply fails this request only
            logger.error("KV read for %s failed: %s", req_id, e)
            result = None
        if result is None:
            logger.error("KV read for %s from %s:%d failed", req_id, remote.host, remote.port)
        self._done_recving.put((req_id, result))

    def _request(self, remote: RemoteMeta, msg: bytes, deadline: float) -> list[bytes] | None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{remote.host}:{remote.port}")
            sock.send_multipart([b"", msg])
            timeout_ms = max(1, int((deadline - time.monotonic()) * 1000))
            if not sock.poll(timeout_ms):
                return None
            return sock.recv_multipart()[1:]
        finally:
            sock.close()

    # -------------------------------------------------------------- each step

    def start_load_kv(self, metadata: ZmqConnectorMetadata, idle: bool = False) -> None:
        """Start this step's reads; hold the newly finished prefill requests
        for their readers."""
        self._idle = idle
        for req_id, meta in metadata.reqs_to_recv.items():
            self._recving_metadata[req_id] = meta
            self._reader.submit(self._read_blocks, req_id, meta)
        with self._lock:
            self._reqs_to_send.update(metadata.reqs_to_send)

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(read by their decode peer or expired, loaded or failed). A step
        with nothing to run waits a little for news instead of spinning."""
        done_sending: set[str] = set()
        while not self._done_sending.empty():
            done_sending.add(self._done_sending.get())
        # The lease: blocks whose reader never came are freed (worker.py:1771).
        now = time.perf_counter()
        with self._lock:
            expired = [r for r, t in self._reqs_to_send.items() if t <= now]
            for req_id in expired:
                del self._reqs_to_send[req_id]
                logger.warning("Releasing the KV blocks of %s: no reader came in time.", req_id)
        done_sending.update(expired)

        done_recving: set[str] = set()
        wait = 0.005 if self._idle and self._recving_metadata else 0.0
        while True:
            try:
                req_id, kv = self._done_recving.get(block=wait > 0, timeout=wait or None)
            except queue.Empty:
                break
            wait = 0.0
            meta = self._recving_metadata.pop(req_id)
            if not meta.local_block_ids:
                continue  # only a notice to the prefill side: nothing waits here
            done_recving.add(req_id)
            if kv is None or kv.shape[1] != len(meta.local_block_ids):
                self._invalid_block_ids.update(meta.local_block_ids)
                continue
            for layer, cache in enumerate(self.kv_caches.values()):
                cache[meta.local_block_ids] = kv[layer].to(cache.device, cache.dtype)
        if self._idle and not done_sending and not done_recving and self._reqs_to_send:
            time.sleep(0.005)  # a held prefill engine: do not spin on the CPU
        return done_sending, done_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    def shutdown(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.join(timeout=1)
        self._reader.shutdown(wait=False, cancel_futures=True)
