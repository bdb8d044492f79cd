"""mini_vllm."""
