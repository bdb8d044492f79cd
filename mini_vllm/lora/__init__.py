"""LoRA: serving many adapters of one base model from one engine (Phase 11).

Mirrors upstream ``vllm/lora/`` at v0.22.1, smaller: ``request.py`` (the
adapter a request names), ``ops/torch_ops/lora_ops.py`` (shrink and expand),
``punica_wrapper/`` (rows to adapter slots) and ``utils.py`` (which modules
an adapter may adapt).
"""
