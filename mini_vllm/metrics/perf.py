"""A step's FLOPs and bytes, from its scheduled tokens and context lengths.

Mirrors upstream ``vllm/v1/metrics/perf.py`` at v0.22.1, the model behind its
MFU metrics (``ObservabilityConfig.enable_mfu_metrics``): ``ExecutionContext``
(:104) sums a step's requests, ``AttentionMetrics`` (:400), ``FfnMetrics``
(:662) and ``UnembedMetrics`` (:919) give the step's FLOPs, bytes read and
bytes written per part, and ``ModelMetrics.get_step_perf_stats_per_gpu``
(:1056) builds the context from a ``SchedulerOutput``. The breakdowns keep
upstream's keys and formulas, so a reader can check one against the other
(tests/upstream/test_perf_metrics.py does, number for number).

What the formulas count, as upstream counts it:

- a linear layer of ``k`` inputs and ``n`` outputs over ``T`` tokens is
  ``2 T k n`` FLOPs; it reads its weights once (``k n`` values) and its input
  (``T k``), and writes its output (``T n``);
- attention over a request's ``num_tokens`` queries and ``context_len`` keys
  (``context_len`` = tokens computed before the step + the step's own) is
  ``2 H num_tokens context_len d`` FLOPs for ``Q K^T`` and as many for ``P V``:
  the whole rectangle, as ``torch.utils.flop_counter`` counts an SDPA call,
  though a causal prefill needs about half of it;
- the logits are computed for one row a prefill request (its last token) and
  for every decode token.

Left out, as upstream leaves them out: norms, rotary embedding, residual adds
and the embedding lookup (no matmul, few bytes). Also left out: tensor and
pipeline parallelism (``per_gpu``), mixture-of-experts, quantized weight sizes
and the config parsers; the sizes come from the Hugging Face config and the
run's dtypes instead. Differs from upstream: ``activation_byte_size`` is the
model's dtype size (upstream fixes it at 2, a FIXME at perf.py:343), so a
float32 run's activation bytes are counted as float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExecutionContext:
    """A step's requests, summed separately for prefills and decodes."""

    num_prefill_requests: int = 0
    prefill_num_tokens: int = 0
    prefill_context_len: int = 0
    prefill_token_context_product: int = 0  # sum of num_tokens * context_len
    num_decode_requests: int = 0
    decode_num_tokens: int = 0
    decode_context_len: int = 0
    decode_token_context_product: int = 0

    def add(self, num_tokens: int, context_len: int, is_prefill: bool) -> None:
        """One request: ``num_tokens`` scheduled this step, ``context_len`` keys seen."""
        if is_prefill:
            self.num_prefill_requests += 1
            self.prefill_num_tokens += num_tokens
            self.prefill_context_len += context_len
            self.prefill_token_context_product += num_tokens * context_len
        else:
            self.num_decode_requests += 1
            self.decode_num_tokens += num_tokens
            self.decode_context_len += context_len
            self.decode_token_context_product += num_tokens * context_len

    def total_num_tokens(self) -> int:
        return self.prefill_num_tokens + self.decode_num_tokens

    def total_token_context_product(self) -> int:
        return self.prefill_token_context_product + self.decode_token_context_product

    def num_logits_tokens(self) -> int:
        """Rows of logits: a prefill's last token, every decode token."""
        return self.num_prefill_requests + self.decode_num_tokens

    # BEGIN LAB 18.1: a step's requests, prefill or decode
    @classmethod
    def from_scheduler_output(cls, scheduler_output) -> ExecutionContext:
        """The step's context as upstream builds it
        (``get_step_perf_stats_per_gpu``): a new request is a prefill; a running
        one is a prefill when it has more than one token scheduled."""
        # HINT: upstream: vllm/v1/metrics/perf.py:1056. context_len = tokens computed
        # HINT: before the step + tokens scheduled now (num_scheduled_tokens[req_id]).
        # HINT: a request with 0 tokens scheduled is skipped.
        ctx = cls()
        scheduled = scheduler_output.num_scheduled_tokens
        for req in scheduler_output.scheduled_new_reqs:
            if n := scheduled.get(req.req_id, 0):
                ctx.add(n, req.num_computed_tokens + n, is_prefill=True)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            if n := scheduled.get(req_id, 0):
                ctx.add(n, computed + n, is_prefill=n > 1)
        return ctx

    # END LAB 18.1


@dataclass
class AttentionMetrics:
    """The attention block of every layer: QKV projection, attention, output projection."""

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    activation_byte_size: int
    weight_byte_size: int
    cache_byte_size: int

    # BEGIN LAB 18.1: attention's FLOPs
    def get_num_flops_breakdown(self, ctx: ExecutionContext) -> dict[str, int]:
        """Keys ``qkv_proj``, ``attn_qk``, ``attn_av``, ``out_proj``: every layer's
        FLOPs (upstream: perf.py:432). A matmul of [T, k] by [k, n] is 2 T k n."""
        # HINT: self._sizes() gives (layers, hidden, heads, kv heads, head dim).
        # HINT: Q K^T and P V each cost 2 * heads * head_dim per (query, key) pair: use
        # HINT: ctx.total_token_context_product(), the whole rectangle (no causal half).
        L, D, q, kv, d = self._sizes()
        T, TC = ctx.total_num_tokens(), ctx.total_token_context_product()
        return {
            "qkv_proj": 2 * T * D * (q + 2 * kv) * d * L,
            "attn_qk": 2 * q * TC * d * L,
            "attn_av": 2 * q * TC * d * L,
            "out_proj": 2 * T * q * d * D * L,
        }

    # END LAB 18.1

    # BEGIN LAB 18.1: attention's bytes read
    def get_read_bytes_breakdown(self, ctx: ExecutionContext) -> dict[str, int]:
        """Keys ``qkv_input``, ``qkv_weight``, ``attn_input`` (only when nonzero),
        ``out_input``, ``out_weight``, in that order (upstream: perf.py:458)."""
        # HINT: activations are activation_byte_size a value, weights weight_byte_size.
        # HINT: a prefill reads its queries and the keys and values of its whole context
        # HINT: (activation bytes); a decode reads its queries (activation bytes) and the
        # HINT: cached keys and values of its context (cache_byte_size).
        L, D, q, kv, d = self._sizes()
        T, act = ctx.total_num_tokens(), self.activation_byte_size
        read = {
            "qkv_input": T * D * act * L,
            "qkv_weight": D * (q + 2 * kv) * d * self.weight_byte_size * L,
        }
        attn_input = 0
        if ctx.prefill_num_tokens:  # the step's queries, keys and values
            prefill = ctx.prefill_num_tokens * q + 2 * ctx.prefill_context_len * kv
            attn_input += prefill * d * act * L
        if ctx.decode_num_tokens:  # the queries, and each row's cached keys and values
            attn_input += ctx.decode_num_tokens * q * d * act * L
            attn_input += 2 * ctx.decode_context_len * kv * d * self.cache_byte_size * L
        if attn_input:
            read["attn_input"] = attn_input
        read["out_input"] = T * q * d * act * L
        read["out_weight"] = q * d * D * self.weight_byte_size * L
        return read

    # END LAB 18.1

    # BEGIN LAB 18.1: attention's bytes written
    def get_write_bytes_breakdown(self, ctx: ExecutionContext) -> dict[str, int]:
        """Keys ``qkv_output``, ``kv_cache``, ``out_output`` (upstream: perf.py:503)."""
        # HINT: every scheduled token writes its key and value into the cache.
        L, D, q, kv, d = self._sizes()
        T, act = ctx.total_num_tokens(), self.activation_byte_size
        return {
            "qkv_output": T * (q + 2 * kv) * d * act * L,
            "kv_cache": 2 * T * kv * d * self.cache_byte_size * L,
            "out_output": T * D * act * L,
        }

    # END LAB 18.1

    def _sizes(self) -> tuple[int, int, int, int, int]:
        return (
            self.num_hidden_layers,
            self.hidden_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
        )


@dataclass
class FfnMetrics:
    """The dense SwiGLU MLP of every layer: gate and up projections, SiLU-and-mul, down."""

    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    activation_byte_size: int
    weight_byte_size: int

    # BEGIN LAB 18.1: the MLP's FLOPs
    def get_num_flops_breakdown(self, ctx: ExecutionContext) -> dict[str, int]:
        """Key ``dense_ffn``: gate, up and down projections (upstream: perf.py:716)."""
        # HINT: three matmuls of hidden_size by intermediate_size over every token and layer.
        L, D, DI = self.num_hidden_layers, self.hidden_size, self.intermediate_size
        T = ctx.total_num_tokens()
        return {"dense_ffn": 2 * D * 3 * DI * T * L}  # gate, up, down: three D x DI matmuls

    # END LAB 18.1

    # BEGIN LAB 18.1: the MLP's bytes read
    def get_read_bytes_breakdown(self, ctx: ExecutionContext) -> dict[str, int]:
        """Keys ``dense_up_gate_input``, ``dense_up_gate_weights``,
        ``dense_silu_input``, ``dense_down_input``, ``dense_down_weights``
        (upstream: perf.py:759, dense layers only)."""
        # HINT: the gate and up weights are two [hidden, intermediate] matrices read as one;
        # HINT: SiLU-and-mul reads both their outputs, down reads one intermediate row a token.
        L, D, DI = self.num_hidden_layers, self.hidden_size, self.intermediate_size
        T, act, w = ctx.total_num_tokens(), self.activation_byte_size, self.weight_byte_size
        return {
            "dense_up_gate_input": T * D * act * L,
            "dense_up_gate_weights": 2 * D * DI * w * L,
            "dense_silu_input": 2 * T * DI * act * L,
            "dense_down_input": T * DI * act * L,
            "dense_down_weights": D * DI * w * L,
        }

    # END LAB 18.1

    # BEGIN LAB 18.1: the MLP's bytes written
    def get_write_bytes_breakdown(self, ctx: ExecutionContext) -> dict[str, int]:
        """Keys ``dense_up_gate_output``, ``dense_silu_output``,
        ``dense_down_output`` (upstream: perf.py:849, dense layers only)."""
        L, D, DI = self.num_hidden_layers, self.hidden_size, self.intermediate_size
        T, act = ctx.total_num_tokens(), self.activation_byte_size
        return {
            "dense_up_gate_output": 2 * T * DI * act * L,
            "dense_silu_output": T * DI * act * L,
            "dense_down_output": T * D * act * L,
        }

    # END LAB 18.1


@dataclass
class UnembedMetrics:
    """The logits: one [hidden, vocab] matmul over the rows that sample."""

    hidden_size: int
    vocab_size: int
    activation_byte_size: int
    weight_byte_size: int

    # BEGIN LAB 18.1: the logits' FLOPs
    def get_num_flops_breakdown(self, ctx: ExecutionContext) -> dict[str, int]:
        """Key ``unembed`` (upstream: perf.py:938)."""
        # HINT: only the rows that sample: ctx.num_logits_tokens().
        return {"unembed": 2 * ctx.num_logits_tokens() * self.hidden_size * self.vocab_size}

    # END LAB 18.1

    def get_read_bytes_breakdown(self, ctx: ExecutionContext) -> dict[str, int]:
        D, V = self.hidden_size, self.vocab_size
        return {
            "input": ctx.num_logits_tokens() * D * self.activation_byte_size,
            "weight": D * V * self.weight_byte_size,
        }

    def get_write_bytes_breakdown(self, ctx: ExecutionContext) -> dict[str, int]:
        return {"output": ctx.num_logits_tokens() * self.vocab_size * self.activation_byte_size}


class ModelMetrics:
    """The three parts of a dense decoder model; breakdown keys are ``"part.key"``."""

    def __init__(
        self, hf_config, dtype: torch.dtype, cache_dtype: torch.dtype | None = None
    ) -> None:
        cfg = hf_config
        size = torch.empty((), dtype=dtype).element_size()
        cache_size = torch.empty((), dtype=cache_dtype or dtype).element_size()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.components = {
            "attn": AttentionMetrics(
                cfg.num_hidden_layers,
                cfg.hidden_size,
                cfg.num_attention_heads,
                getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                head_dim,
                activation_byte_size=size,
                weight_byte_size=size,
                cache_byte_size=cache_size,
            ),
            "ffn": FfnMetrics(
                cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, size, size
            ),
            "unembed": UnembedMetrics(cfg.hidden_size, cfg.vocab_size, size, size),
        }

    def _breakdown(self, method: str, ctx: ExecutionContext) -> dict[str, int]:
        return {
            f"{part}.{key}": value
            for part, component in self.components.items()
            for key, value in getattr(component, method)(ctx).items()
        }

    def get_num_flops_breakdown(self, ctx: ExecutionContext) -> dict[str, int]:
        return self._breakdown("get_num_flops_breakdown", ctx)

    def get_read_bytes_breakdown(self, ctx: ExecutionContext) -> dict[str, int]:
        return self._breakdown("get_read_bytes_breakdown", ctx)

    def get_write_bytes_breakdown(self, ctx: ExecutionContext) -> dict[str, int]:
        return self._breakdown("get_write_bytes_breakdown", ctx)

    def get_num_flops(self, ctx: ExecutionContext) -> int:
        return sum(self.get_num_flops_breakdown(ctx).values())
