"""What the model runner hands back to the scheduler each step.

Mirrors upstream ``vllm/v1/outputs.py`` at v0.22.1 (``ModelRunnerOutput``
:233). Left out: pooling, connector, NaN counts, CUDA-graph stats.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # One list per request: the tokens sampled this step. Empty for a
    # request whose prompt is still being prefilled.
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # Optional per-request top-n logprobs (filled by the sampler).
    logprobs: list | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={})
