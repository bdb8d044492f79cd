"""Helpers shared by Phase 06's graded suites: calling your code, small
processors, the chi-square tail, and the engine with your pieces plugged in.

(Imported by name from the suites: this folder is on sys.path because pytest
puts the folder of ``conftest.py`` there.)
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from mini_vllm.grading.checks import written  # noqa: F401 (the lab tests import it from here)
from mini_vllm.oracle.sampler_workload import CONFIG

CPU = torch.device("cpu")


def processor(cls, max_num_seqs: int = 8):
    """A logits processor built as the runner builds it (config, device, no pinning)."""
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        model_config=CONFIG.model_config,
    )
    return cls(config, CPU, False)


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X chi-square with ``df`` degrees of freedom, exactly.

    Q(x; 1) = erfc(sqrt(x / 2)), Q(x; 2) = exp(-x / 2), and
    Q(x; k + 2) = Q(x; k) + (x / 2)^(k / 2) exp(-x / 2) / Gamma(k / 2 + 1).
    """
    if x <= 0:
        return 1.0
    half = x / 2
    q, k = (math.erfc(math.sqrt(half)), 1) if df % 2 else (math.exp(-half), 2)
    while k < df:
        q += math.exp((k / 2) * math.log(half) - half - math.lgamma(k / 2 + 1))
        k += 2
    return min(q, 1.0)


def plug_into_engine(impl, monkeypatch) -> None:
    """Make the engine run your Phase 06 pieces: the runner builds your
    ``Sampler`` and your logit_bias / min_p processors; the reference code
    around your regions finds your penalties, top-k / top-p and
    ``process_dict_updates`` through the module names it calls them by."""
    from mini_vllm.sample.logits_processor import builtin
    from mini_vllm.sample.ops import penalties, topk_topp_sampler
    from mini_vllm.worker import gpu_model_runner

    monkeypatch.setattr(gpu_model_runner, "Sampler", impl.sampler.Sampler)
    for name in ("LogitBiasLogitsProcessor", "MinPLogitsProcessor"):
        monkeypatch.setattr(gpu_model_runner, name, getattr(impl.builtin, name))
    monkeypatch.setattr(builtin, "process_dict_updates", impl.builtin.process_dict_updates)
    for name in ("apply_penalties", "apply_repetition_penalties"):
        monkeypatch.setattr(penalties, name, getattr(impl.penalties, name))
    for name in ("apply_top_k_top_p", "apply_top_k_only"):
        monkeypatch.setattr(topk_topp_sampler, name, getattr(impl.topk_topp_sampler, name))
