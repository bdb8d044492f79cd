"""A deterministic fake KV connector, for the live lockstep with upstream.

No upstream counterpart: upstream's own scheduler tests fake their
connectors inside the test files (tests/v1/kv_connector/unit/utils.py).
The same logic, ``FakeConnectorLogic``, runs inside mini_vllm's scheduler
(``FakeKVConnector`` here, on mini_vllm's ``KVConnectorBase_V1``) and inside
upstream's (``mini_vllm/oracle/fake_connector_upstream.py``, on upstream's
base, loaded through ``kv_connector_module_path``). Its ``plan`` (in
``kv_connector_extra_config``) says per request id:

- ``hit``: prompt tokens the fake store holds (it answers up to that many
  beyond the local prefix hit; at most ``num_tokens - 1`` for a synchronous
  load, whose last token must be computed);
- ``async``: whether they load asynchronously (WAITING_FOR_REMOTE_KVS);
  once one asynchronous load of the request has ended, later queries (after
  a preemption or a failure) load synchronously, as a remote prefill is
  pulled once (upstream's scheduler would otherwise load a one-token prompt
  forever: it recomputes the last token of a full hit, scheduler.py:2099);
- ``unknown``: how many first queries answer ``None`` ("ask again");
- ``delay``: steps until an asynchronous load is reported done (0: the
  step that scheduled it);
- ``fail``: which of the loaded blocks fail (indexes, modulo their count;
  an int is one index), reported with the request's first load (None: none
  fails; a retry loads cleanly, as a store that dropped a corrupt entry);
- ``save``: when set, ``request_finished`` keeps the blocks for a save
  reported done that many steps after it starts.

The scheduler half records every call with its arguments (``calls``), and
its metadata lists the step's loads and saves; ``FakeWorker`` plays the
worker half from that metadata and builds each step's report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mini_vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


@dataclass
class FakeLoad:
    req_id: str
    # The blocks the load fills (the request's blocks past its local hit).
    block_ids: list[int]
    is_async: bool
    delay: int
    fail: list[int] | None


@dataclass
class FakeSave:
    req_id: str
    delay: int


@dataclass
class FakeConnectorMetadataFields:
    loads: list[FakeLoad] = field(default_factory=list)
    saves: list[FakeSave] = field(default_factory=list)


class FakeConnectorLogic:
    """The scheduler half; mixed into a backend's KVConnectorBase_V1."""

    metadata_cls: type = FakeConnectorMetadataFields

    def _init_fake(self, extra_config: dict) -> None:
        self.plan: dict[str, dict] = extra_config.get("plan", {})
        block_size = extra_config.get("block_size")
        assert block_size, "the fake connector needs block_size in its extra config"
        self.block_size = block_size
        self.calls: list[list] = []
        self._num_queries: dict[str, int] = {}
        self._local_hit: dict[str, int] = {}
        self._loading: set[str] = set()
        self._loaded_once: set[str] = set()
        self._received: set[str] = set()
        self._meta = self.metadata_cls()

    def _entry(self, req_id: str) -> dict:
        entry = {"hit": 0, "async": False, "unknown": 0, "delay": 0, "fail": None, "save": None}
        entry.update(self.plan.get(req_id, {}))
        return entry

    def take_calls(self) -> list[list]:
        calls, self.calls = self.calls, []
        return calls

    # --------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        req_id = request.request_id
        plan = self._entry(req_id)
        query = self._num_queries.get(req_id, 0)
        self._num_queries[req_id] = query + 1
        if query < plan["unknown"]:
            result = (None, False)
        else:
            is_async = bool(plan["async"]) and req_id not in self._received
            limit = request.num_tokens if is_async else request.num_tokens - 1
            num = max(0, min(plan["hit"], limit) - num_computed_tokens)
            result = (num, is_async and num > 0)
        self._local_hit[req_id] = num_computed_tokens
        self.calls.append(["get_num_new_matched_tokens", req_id, num_computed_tokens, *result])
        return result

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        req_id = request.request_id
        (block_ids,) = blocks.get_block_ids()
        self.calls.append(
            ["update_state_after_alloc", req_id, list(block_ids), num_external_tokens]
        )
        if num_external_tokens == 0:
            return
        plan = self._entry(req_id)
        local = self._local_hit[req_id]
        first = local // self.block_size
        last = -(-(local + num_external_tokens) // self.block_size)
        is_async = bool(plan["async"]) and req_id not in self._received
        if is_async:
            self._loading.add(req_id)
        fail = None if req_id in self._loaded_once else plan["fail"]
        if isinstance(fail, int):
            fail = [fail]
        self._loaded_once.add(req_id)
        self._meta.loads.append(
            FakeLoad(req_id, list(block_ids[first:last]), is_async, plan["delay"], fail)
        )

    def build_connector_meta(self, scheduler_output):
        meta, self._meta = self._meta, self.metadata_cls()
        self.calls.append(
            [
                "build_connector_meta",
                [[x.req_id, x.block_ids, x.is_async] for x in meta.loads],
                [x.req_id for x in meta.saves],
            ]
        )
        return meta

    def update_connector_output(self, connector_output):
        self.calls.append(
            [
                "update_connector_output",
                sorted(connector_output.finished_sending or ()),
                sorted(connector_output.finished_recving or ()),
                sorted(connector_output.invalid_block_ids),
            ]
        )
        self._loading -= set(connector_output.finished_recving or ())
        self._received |= set(connector_output.finished_recving or ())

    def request_finished(self, request, block_ids):
        req_id = request.request_id
        plan = self._entry(req_id)
        delay = plan["save"] is not None and req_id not in self._loading
        if delay:
            self._meta.saves.append(FakeSave(req_id, plan["save"]))
        self.calls.append(["request_finished", req_id, list(block_ids), delay])
        return delay, None

    # ------------------------------------------ worker side (FakeWorker's job)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return

    def wait_for_save(self) -> None:
        return


class FakeWorker:
    """The worker half, played by the driver: reads each step's metadata
    and says, step by step, which loads and saves ended and which blocks
    failed, as ``(finished_sending, finished_recving, invalid_block_ids)``."""

    def __init__(self) -> None:
        # step -> [(kind, req_id)]; step -> block ids that fail then.
        self.due: dict[int, list[tuple[str, str]]] = {}
        self.failing: dict[int, set[int]] = {}

    def step(self, step: int, meta) -> tuple[set[str], set[str], set[int]]:
        for load in meta.loads if meta is not None else ():
            done = step + (load.delay if load.is_async else 0)
            if load.is_async:
                self.due.setdefault(done, []).append(("recving", load.req_id))
            if load.fail and load.block_ids:
                bad = {load.block_ids[i % len(load.block_ids)] for i in load.fail}
                self.failing.setdefault(done, set()).update(bad)
        for save in meta.saves if meta is not None else ():
            self.due.setdefault(step + save.delay, []).append(("sending", save.req_id))
        events = self.due.pop(step, [])
        sending = {r for kind, r in events if kind == "sending"}
        recving = {r for kind, r in events if kind == "recving"}
        return sending, recving, self.failing.pop(step, set())

    def pending(self) -> bool:
        return bool(self.due or self.failing)


class FakeConnectorMetadata(FakeConnectorMetadataFields, KVConnectorMetadata):
    pass


class FakeKVConnector(FakeConnectorLogic, KVConnectorBase_V1):
    metadata_cls = FakeConnectorMetadata

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        self._init_fake(vllm_config.kv_transfer_config.kv_connector_extra_config)
