"""Multimodal inputs: images whose encoder output fills placeholder positions (Phase 13).

Mirrors upstream ``vllm/multimodal/`` at v0.22.1, smaller: ``inputs.py`` (where
an item sits in the prompt and the feature a request carries for it).
"""
