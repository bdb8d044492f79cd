"""Logits processors: the API, the built-ins, and the batch-update plumbing.

Mirrors upstream ``vllm/v1/sample/logits_processor/__init__.py`` at v0.22.1:
its list of built-ins (min_tokens, logit_bias, min_p, in that order), which
``build_logitsprocs`` :184 instantiates for a generating model. Left out
(see UPSTREAM_PIN.md): ``build_logitsprocs`` itself, loading processors from
entry-point plugins (``_load_logitsprocs_plugins`` :56) or by qualified
name, and ``AdapterLogitsProcessor`` :234 for per-request processors; those
come with ``LLM(..., logits_processors=[...])``.
"""

from mini_vllm.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
    process_dict_updates,
)
from mini_vllm.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)
from mini_vllm.sample.logits_processor.state import BatchUpdateBuilder, LogitsProcessors

BUILTIN_LOGITS_PROCESSORS: list[type[LogitsProcessor]] = [
    MinTokensLogitsProcessor,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
]

__all__ = [
    "BUILTIN_LOGITS_PROCESSORS",
    "BatchUpdate",
    "BatchUpdateBuilder",
    "LogitBiasLogitsProcessor",
    "LogitsProcessor",
    "LogitsProcessors",
    "MinPLogitsProcessor",
    "MinTokensLogitsProcessor",
    "MoveDirectionality",
    "process_dict_updates",
]
