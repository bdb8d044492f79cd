"""Test-suite wiring: markers, the upstream requirement, and a closing summary.

- ``upstream`` tests drive the pinned vLLM. Without it they are skipped
  (visibly, with the reason), unless MINI_VLLM_REQUIRE_UPSTREAM is set, as
  `make test` and CI do: then a missing pin is an error, never a silent skip.
- ``gpu`` tests need CUDA and are skipped, visibly, where there is none.
- Without CUDA, Triton kernels run under its interpreter (TRITON_INTERPRET=1).
- phase_times.py prints the seconds each phase's honesty checks took.
- Models loaded by several test files load once per run (session fixtures):
  SmolLM2 in transformers costs ~11 s of CPU a load. mini_vllm's own loads
  share one GGUF cache entry per run (below).
- Tiers (mini_vllm/tiers.py): a bare ``pytest`` runs the fast tier, as
  ``make test`` does; tests marked ``deep`` run only under
  MINI_VLLM_TIER=deep (``make test-deep``) and are deselected, and counted,
  otherwise.
- Under pytest-xdist each worker keeps its own counters; the controller adds
  them up for the closing summary.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile

import phase_times
import pytest

# Triton decides at import time whether kernels are compiled or interpreted.
# Without a GPU, interpret them (on CPU tensors); this must precede any
# import of triton, hence here, before test modules are collected.
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch as _torch

        if not _torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass

# A bare `pytest` is the fast tier; subprocesses (the graders) inherit it.
os.environ.setdefault("MINI_VLLM_TIER", "fast")

# The GGUF cache (mini_vllm/model_executor/model_loader/gguf_cache.py) lives
# in a folder of this run's own, never the user's: the run's first SmolLM2
# load reads the GGUF and writes the entry, every later load (tests, graders,
# notebooks and doc examples, which inherit the variable) reads the float32
# weights it holds, bit for bit the GGUF's (tests/test_gguf_cache.py proves
# it). pytest-xdist's workers inherit the controller's folder; the process
# that made it removes it at the end.
_OWN_CACHE = None
if "MINI_VLLM_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="mini_vllm-test-cache-")
    os.environ["MINI_VLLM_CACHE_DIR"] = _OWN_CACHE

HAVE_UPSTREAM = importlib.util.find_spec("vllm") is not None


def _have_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_configure(config):
    from mini_vllm.tiers import tier

    try:
        tier()
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    config.mini_vllm_counts = {}
    config.pluginmanager.register(phase_times, "phase_times")
    # The tests run small tensors; with two threads on two busy cores each op
    # pays a synchronisation cost far larger than its work.
    try:
        import torch as _torch

        _torch.set_num_threads(1)
    except ImportError:
        pass
    if not HAVE_UPSTREAM and os.environ.get("MINI_VLLM_REQUIRE_UPSTREAM"):
        raise pytest.UsageError(
            "MINI_VLLM_REQUIRE_UPSTREAM is set but vllm is not installed: run `make upstream`."
        )
    if _OWN_CACHE and getattr(config.option, "numprocesses", None):
        # Workers would race to write the entry: the controller writes it first.
        from mini_vllm.model_executor.model_loader import smollm2_gguf_path
        from mini_vllm.model_executor.model_loader.gguf_cache import cached_gguf

        cached_gguf(smollm2_gguf_path())


def pytest_unconfigure(config):
    if _OWN_CACHE:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    from mini_vllm.tiers import tier

    if tier() == "fast":
        deep = [item for item in items if "deep" in item.keywords]
        if deep:
            config.hook.pytest_deselected(items=deep)
            items[:] = [item for item in items if "deep" not in item.keywords]
            config.mini_vllm_counts["deep-tier tests deselected (make test-deep runs them)"] = len(
                deep
            )
    no_upstream = pytest.mark.skip(
        reason="pinned upstream vllm 0.22.1 not installed (make upstream)"
    )
    no_cuda = pytest.mark.skip(reason="no CUDA device on this machine")
    have_cuda = None
    for item in items:
        if "upstream" in item.keywords and not HAVE_UPSTREAM:
            item.add_marker(no_upstream)
        if "gpu" in item.keywords:
            if have_cuda is None:
                have_cuda = _have_cuda()
            if not have_cuda:
                item.add_marker(no_cuda)


@pytest.fixture(scope="session")
def counts(pytestconfig) -> dict:
    """A session-wide dict of counters printed at the end of the run."""
    return pytestconfig.mini_vllm_counts


def pytest_sessionfinish(session):
    """An xdist worker hands its counters to the controller."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["mini_vllm_counts"] = dict(session.config.mini_vllm_counts)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller adds up each worker's counters."""
    totals = node.config.mini_vllm_counts
    for key, value in node.workeroutput.get("mini_vllm_counts", {}).items():
        if isinstance(value, int) and not key.startswith("deep-tier"):
            totals[key] = totals.get(key, 0) + value
        else:  # counted by every worker alike (at collection), or not a count
            totals[key] = value


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if config.mini_vllm_counts:
        terminalreporter.section("mini_vllm counters")
        for key, value in sorted(config.mini_vllm_counts.items()):
            terminalreporter.write_line(f"{key}: {value}")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """(folder, transformers model) of the tiny seeded Qwen3 checkpoint (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from mini_vllm.model_executor.model_loader.tiny import make_tiny_model

    folder = tmp_path_factory.mktemp("tiny_qwen3")
    make_tiny_model(folder, arch="qwen3", seed=0)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    hf.eval()
    return str(folder), hf


@pytest.fixture(scope="session")
def smollm2_hf():
    """(GGUF path, transformers model) of SmolLM2-135M-Instruct, fp32, eval:
    the oracle of test_engine, test_kv_cache_interface and test_models, which
    only run it (never change its weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from mini_vllm.model_executor.model_loader import smollm2_gguf_path

    path = smollm2_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return path, hf.eval()
