"""Upstream's ``vllm/compilation/``: here only the CUDA-graph wrapper (Phase 18)."""
