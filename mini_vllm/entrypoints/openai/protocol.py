"""The OpenAI API's request and response shapes, for what mini_vllm serves.

Mirrors upstream ``vllm/entrypoints/openai/engine/protocol.py`` (``OpenAIBaseModel``
:27, ``ErrorInfo`` :59, ``ErrorResponse`` :66, ``ModelCard`` :85, ``ModelList`` :96,
``UsageInfo`` :105, ``JsonSchemaResponseFormat`` :117, ``ResponseFormat`` :150,
``StreamOptions`` :161, ``DeltaMessage`` :267) at v0.22.1, with
``VLLMValidationError`` (vllm/exceptions.py:9), ``CompletionRequest``
(vllm/entrypoints/openai/completion/protocol.py:42),
``CompletionLogProbs`` (vllm/entrypoints/openai/completion/protocol.py:466),
``CompletionStreamResponse`` (vllm/entrypoints/openai/completion/protocol.py:536)
and the other completion responses beside them, ``ChatMessage``
(vllm/entrypoints/openai/chat_completion/protocol.py:54), the chat logprobs
(``ChatCompletionLogProbs``, vllm/entrypoints/openai/chat_completion/protocol.py:80)
and the chat responses beside them. Response
fields keep upstream's names, order and defaults, so that the streamed chunks
are upstream's byte for byte; fields mini_vllm never sets (service tier, prompt
logprobs, prompt text, routing fields) are left out of the models. With
``return_token_ids`` a choice carries its ``token_ids`` and the prompt's
``prompt_token_ids`` (a completion choice; the chat response itself, and a
chat stream's first chunk).

Requests: every field a client may send that mini_vllm's ``SamplingParams`` has
is passed to it by name (``to_sampling_params``); when SamplingParams gains a
field, declaring it here is the one line needed. A field mini_vllm cannot honour
(``UNSUPPORTED``) is accepted at its default and refused otherwise with a 400
naming it. Unknown fields are ignored, as upstream (``extra="allow"``).

Upstream's request validators run as the body is parsed (a 400 before anything
starts, a stream included): ``stream_options`` only with ``stream``, a
``json_schema`` response format needs its schema, logprob counts not negative,
chat ``top_logprobs`` only with ``logprobs``, a completion prompt not empty.
Structured outputs come as upstream's: ``response_format`` (``json_schema`` /
``json_object``; ``text`` is plain generation) or vLLM's ``structured_outputs``
field, both becoming ``SamplingParams.structured_outputs``
(``structural_tag`` is left out, as in Phase 12).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mini_vllm.sampling_params import SamplingParams, StructuredOutputsParams

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    # The OpenAI API allows extra fields.
    model_config = ConfigDict(extra="allow")


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class VLLMValidationError(ValueError):
    """A bad request field: a 400 whose ``param`` names it."""

    def __init__(self, message: str, *, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


class UnsupportedParameterError(VLLMValidationError):
    """A request field that mini_vllm cannot honour (a 400 naming it)."""

    def __init__(self, parameter: str, value) -> None:
        super().__init__(
            f"mini_vllm does not support `{parameter}` (got {value!r}).", parameter=parameter
        )


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[dict] = Field(default_factory=list)


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaResponseFormat(OpenAIBaseModel):
    name: str
    description: str | None = None
    # OpenAI calls it "schema", a name pydantic's BaseModel already uses.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


_SAMPLING_PARAMS_FIELDS = {
    f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_")
}


class _SamplingRequest(OpenAIBaseModel):
    """The fields both endpoints share, with upstream's defaults."""

    model: str | None = None
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: str | list[str] | None = []
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_token_ids: list[int] | None = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    user: str | None = None
    # Passed on to SamplingParams (Phase 06).
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    # Structured outputs (Phase 12): vLLM's field, passed on by name, and OpenAI's.
    structured_outputs: StructuredOutputsParams | None = None
    response_format: ResponseFormat | None = None
    # Disaggregated serving (Phase 15): the KV connector's parameters, passed
    # on in SamplingParams.extra_args (vllm/entrypoints/openai/completion/protocol.py:310).
    kv_transfer_params: dict[str, Any] | None = None
    # The prompt's and the output's token ids beside the text (upstream's
    # vLLM-only field, vllm/entrypoints/openai/chat_completion/protocol.py:365;
    # streamed: the prompt's on a choice's first chunk, each chunk's new ones).
    return_token_ids: bool | None = None
    # Accepted at these defaults only (UNSUPPORTED).
    use_beam_search: bool = False
    prompt_logprobs: int | None = None

    # Refused unless at their default; one SamplingParams gains is passed on instead.
    UNSUPPORTED: ClassVar[tuple[str, ...]] = ("use_beam_search", "prompt_logprobs")

    @model_validator(mode="before")
    @classmethod
    def validate_stream_options(cls, data):
        if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):
            raise VLLMValidationError(
                "Stream options can only be defined when `stream=True`.",
                parameter="stream_options",
            )
        return data

    @model_validator(mode="before")
    @classmethod
    def validate_response_format(cls, data):
        response_format = data.get("response_format") if isinstance(data, dict) else None
        if (
            isinstance(response_format, dict)
            and response_format.get("type") == "json_schema"
            and response_format.get("json_schema") is None
        ):
            raise VLLMValidationError(
                "When response_format type is 'json_schema', the 'json_schema' field "
                "must be provided.",
                parameter="response_format",
            )
        return data

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """``structured_outputs`` with ``response_format`` folded in, as upstream."""
        response_format = self.response_format
        if response_format is None or response_format.type == "text":
            return self.structured_outputs
        if response_format.type == "json_object":
            constraint = {"json_object": True}
        else:
            constraint = {"json": response_format.json_schema.json_schema}
        if self.structured_outputs is None:
            return StructuredOutputsParams(**constraint)
        return dataclasses.replace(self.structured_outputs, **constraint)

    def check_supported(self) -> None:
        """Refuse every field mini_vllm cannot honour that differs from its default."""
        # BEGIN LAB 16.2: refuse what SamplingParams cannot honour, naming the field
        # HINT: receives self (a parsed request); returns nothing or raises.
        # HINT: for each name in self.UNSUPPORTED that SamplingParams does not have
        # HINT: (_SAMPLING_PARAMS_FIELDS): compare the value with the field's default
        # HINT: (type(self).model_fields[name].get_default(call_default_factory=True));
        # HINT: a different value raises UnsupportedParameterError(name, value).
        for name in self.UNSUPPORTED:
            if name in _SAMPLING_PARAMS_FIELDS:
                continue
            value = getattr(self, name)
            if value != type(self).model_fields[name].get_default(call_default_factory=True):
                raise UnsupportedParameterError(name, value)
        # END LAB 16.2

    def sampling_kwargs(self) -> dict[str, Any]:
        """Every set field SamplingParams has, by name (None: SamplingParams' default)."""
        # BEGIN LAB 16.2: request fields to SamplingParams keyword arguments
        # HINT: receives self; returns the keyword arguments after checking them.
        # HINT: refuse first (self.check_supported()), then keep every declared field
        # HINT: (type(self).model_fields) that SamplingParams has and that is not None:
        # HINT: None means "SamplingParams' own default", so it is left out.
        self.check_supported()
        return {
            name: getattr(self, name)
            for name in type(self).model_fields
            if name in _SAMPLING_PARAMS_FIELDS and getattr(self, name) is not None
        }
        # END LAB 16.2

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """SamplingParams for this request (a bad value raises ValueError)."""
        kwargs = {**self.sampling_kwargs(), "max_tokens": max_tokens}
        if (structured_outputs := self.structured_outputs_params()) is not None:
            kwargs["structured_outputs"] = structured_outputs
        if self.kv_transfer_params:
            kwargs["extra_args"] = {"kv_transfer_params": self.kv_transfer_params}
        if kwargs.get("logit_bias"):
            # As upstream's SamplingParams.from_optional (vllm/sampling_params.py:325):
            # JSON keys are strings; biases are clipped to [-100, 100].
            kwargs["logit_bias"] = {
                int(token): min(100.0, max(-100.0, bias))
                for token, bias in kwargs["logit_bias"].items()
            }
        return SamplingParams(**kwargs)


class CompletionRequest(_SamplingRequest):
    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None

    UNSUPPORTED = (*_SamplingRequest.UNSUPPORTED, "echo", "suffix")

    @model_validator(mode="before")
    @classmethod
    def validate_prompt(cls, data):
        if isinstance(data, dict):
            prompt = data.get("prompt")
            if prompt is None or prompt == "":
                raise ValueError("Either prompt or prompt_embeds must be provided and non-empty.")
            logprobs = data.get("logprobs")
            if isinstance(logprobs, int) and logprobs < 0:
                raise VLLMValidationError(
                    "`logprobs` must be a positive value.", parameter="logprobs"
                )
        return data


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    # Here logprobs is a bool; the engine's count is top_logprobs.
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    tools: list[dict[str, Any]] | None = None

    UNSUPPORTED = (*_SamplingRequest.UNSUPPORTED, "tools")

    @model_validator(mode="before")
    @classmethod
    def check_logprobs(cls, data):
        top_logprobs = data.get("top_logprobs") if isinstance(data, dict) else None
        if isinstance(top_logprobs, int):
            if top_logprobs < -1:
                raise VLLMValidationError(
                    "`top_logprobs` must be a positive value or -1.", parameter="top_logprobs"
                )
            if top_logprobs != 0 and not data.get("logprobs"):
                raise VLLMValidationError(
                    "when using `top_logprobs`, `logprobs` must be set to true.",
                    parameter="top_logprobs",
                )
        return data

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = super().sampling_kwargs()
        kwargs.pop("logprobs", None)
        if self.logprobs and self.top_logprobs is not None:
            kwargs["logprobs"] = self.top_logprobs
        return kwargs


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo
    # The prefill engine's answer to a disaggregated request (Phase 15).
    kv_transfer_params: dict[str, Any] | None = None


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = Field(default=None)
    system_fingerprint: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None
    # The prefill engine's answer to a disaggregated request (Phase 15).
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = Field(default=None)
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None
