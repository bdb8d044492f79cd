"""The Phase 19 benchmark runs and measures what it says
(mini_vllm/benchmarks/scheduler_designs.py), at its tiny setting:

- every design runs both workloads and returns v1's greedy tokens;
- the ``ample`` workload never preempts; under ``pressure`` v1 preempts and
  recomputes tokens, and ``swap`` swaps every victim out and back in and
  recomputes none, with the bytes it reports copied;
- the conditions (threads, load average, repeats, the command) are stated.
"""

from __future__ import annotations

import json

from mini_vllm.benchmarks import scheduler_designs as bench


def test_the_tiny_run_measures_the_three_designs(tmp_path):
    assert bench.main(["--tiny-only", "--repeats", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "scheduler_designs_tiny.json").read_text())
    meta = result["meta"]
    assert "1 thread" in meta["device"] and meta["repeats"] == 1
    assert meta["command"].startswith("python -m mini_vllm.benchmarks.scheduler_designs")
    for name in ("ample", "pressure"):
        section = result[name]
        assert set(section["summary"]) == set(bench.DESIGNS)
        assert set(section["same_tokens_as_v1"].values()) == {
            f"{bench.NUM_REQUESTS}/{bench.NUM_REQUESTS}"
        }
        for s in section["summary"].values():
            assert "loadavg_1m" in s and s["tokens_per_s"] > 0
            assert s["ttft_s"]["p50"] <= s["ttft_s"]["p90"] <= s["ttft_s"]["p99"]
            assert s["tpot_s"]["p50"] <= s["tpot_s"]["p90"] <= s["tpot_s"]["p99"]
    for s in result["ample"]["summary"].values():
        assert s["preemptions"] == 0 and s["recomputed_tokens"] == 0, "ample must not preempt"
    v1, swap = result["pressure"]["summary"]["v1"], result["pressure"]["summary"]["swap"]
    assert v1["preemptions"] > 0 and v1["recomputed_tokens"] > 0, "pressure must preempt"
    assert swap["swapped_out"] == swap["preemptions"] > 0
    assert swap["swapped_in"] == swap["swapped_out"] and swap["recomputed_tokens"] == 0
    assert swap["bytes_swapped"] > 0 and v1["bytes_swapped"] == 0
    svr = result["swap_vs_recompute"]
    assert svr["bytes_swapped"] == swap["bytes_swapped"]
    assert svr["v1_recomputed_tokens"] == v1["recomputed_tokens"]
