"""Distributed pieces (upstream ``vllm/distributed/``): for now only KV transfer."""
