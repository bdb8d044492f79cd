"""KV transfer between engines and to storage (upstream ``vllm/distributed/kv_transfer/``)."""
