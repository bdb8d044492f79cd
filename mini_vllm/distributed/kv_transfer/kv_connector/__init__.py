"""KV connectors (upstream ``vllm/distributed/kv_transfer/kv_connector/``)."""
