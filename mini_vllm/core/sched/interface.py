"""What the engine needs from a scheduler: the methods ``EngineCore`` calls.

Mirrors upstream ``vllm/v1/core/sched/interface.py`` (``SchedulerInterface``
:36) at v0.22.1, keeping only the methods mini_vllm's engine and tests use,
under upstream's names. A scheduler you plug in through
``SchedulerConfig.scheduler_cls`` implements these (subclassing the
reference ``Scheduler`` does). What is left out is listed in UPSTREAM_PIN.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mini_vllm.config import VllmConfig
    from mini_vllm.core.sched.output import GrammarOutput, SchedulerOutput
    from mini_vllm.engine import EngineCoreOutputs
    from mini_vllm.metrics.stats import SchedulerStats
    from mini_vllm.outputs import DraftTokenIds, ModelRunnerOutput
    from mini_vllm.request import Request, RequestStatus
    from mini_vllm.structured_output import StructuredOutputManager


class SchedulerInterface(ABC):
    @abstractmethod
    def __init__(
        self,
        vllm_config: VllmConfig,
        log_stats: bool = False,
        structured_output_manager: StructuredOutputManager | None = None,
    ) -> None:
        """The engine passes its StructuredOutputManager (upstream: interface.py:38)."""
        raise NotImplementedError

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Decide this step: which requests run, and how many tokens each."""
        raise NotImplementedError

    @abstractmethod
    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """This step's grammar bitmask for the structured requests that
        sample, in scheduled order; None when there are none."""
        raise NotImplementedError

    @abstractmethod
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Take in the model's sampled tokens; return the step's outputs.
        (Upstream returns one EngineCoreOutputs per client index.)"""
        raise NotImplementedError

    @abstractmethod
    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """Hand each request the drafts proposed after this step; they are
        scheduled (and verified) next step."""
        raise NotImplementedError

    @abstractmethod
    def add_request(self, request: Request) -> None:
        raise NotImplementedError

    @abstractmethod
    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> list[str]:
        """Finish requests from outside (abort, stop string). Upstream returns
        (request id, client index) pairs; mini_vllm has one client."""
        raise NotImplementedError

    @abstractmethod
    def get_num_unfinished_requests(self) -> int:
        raise NotImplementedError

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    @abstractmethod
    def has_finished_requests(self) -> bool:
        """Finished since the last schedule(), not yet told to the workers."""
        raise NotImplementedError

    def has_requests(self) -> bool:
        """Work left: unfinished requests, or finished ids not yet reported."""
        return self.has_unfinished_requests() or self.has_finished_requests()

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        raise NotImplementedError

    @abstractmethod
    def make_stats(self) -> SchedulerStats | None:
        """This step's stats, or None when ``log_stats`` is off."""
        raise NotImplementedError
