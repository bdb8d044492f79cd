"""Upstream's ``vllm/compilation/``: the CUDA-graph wrapper and torch.compile's
trace-once decorator and wrapper (Phase 18)."""
