"""Checking mini_vllm against the pinned upstream vLLM.

- ``workload``: a workload (requests, arrivals, aborts, what the fake model
  emits) and a driver that runs it through any scheduler with upstream's
  interface, recording every step as plain data (a *trace*);
- ``upstream``: builds the pinned upstream Scheduler on a CPU with the same
  keywords as ``mini_vllm.testing`` (needs ``make upstream``);
- ``snapshots``: named scenarios, recorded from upstream into JSON and
  compared against without upstream installed;
- ``kv_workload``, ``kv_scenarios``, ``kv_snapshots``, ``kv_strategies``: the
  same for the KV cache alone: sequences of ``KVCacheManager`` operations
  (lookups, allocations, appends, frees, preemptions), a driver recording
  the manager's and block pool's state after each, named scenarios recorded
  from upstream into tests/snapshots/kv_cache, and a generator of valid
  sequences for the KV lockstep.
"""
