"""Distributed pieces (upstream ``vllm/distributed/``): the process groups and
their collectives (parallel_state.py, communication_op.py) and KV transfer."""
