"""Llama: a pre-norm decoder with grouped-query attention, RoPE and a SwiGLU MLP.

Mirrors upstream ``vllm/model_executor/models/llama.py`` at v0.22.1
(``LlamaMLP`` at :81, ``LlamaAttention`` at :124, ``LlamaDecoderLayer`` at
:253, ``LlamaModel`` at :350 with its ``LlamaModel.load_weights`` at :436,
``LlamaForCausalLM`` at :501). ``LlamaModel`` is compiled as upstream's
(``@support_torch_compile``, :340; mini_vllm/compilation/decorators.py)
when the compilation mode asks for it. Left out: pipeline parallelism, LoRA, EAGLE hooks,
bidirectional (encoder-only) use,
``logit_scale``, and the GGUF-specific GPT-J RoPE (mini_vllm's loader
un-permutes GGUF q/k weights instead). Sliding-window layers as upstream's
``LlamaAttention`` sets them (:184-203): a config's ``layer_types`` names
each layer ``"full_attention"`` or ``"sliding_attention"``, the latter with
``config.sliding_window``; transformers' Ministral is this model with
``layer_types`` (the architecture the hybrid tests run).

Kept from upstream: q, k and v come out of one fused ``qkv_proj`` matmul,
gate and up out of one ``gate_up_proj``; ``load_weights`` takes Hugging
Face tensor names and hands each ``q_proj``/``k_proj``/``v_proj`` (or
``gate_proj``/``up_proj``) to its layer's ``weight_loader`` with its shard
id. Every linear layer and the embedding take a ``quant_config`` and let
its method own their weights (layers/quantization/): a GGUF checkpoint's
``qweight``/``qweight_type`` tensors load the same way as ``weight``. The residual
add is fused into the next RMSNorm call, as upstream does.

Tensor parallelism (upstream's, through the parallel layers): each rank
holds ``num_heads / tp`` query heads and ``num_kv_heads / tp`` KV heads (one,
shared, when there are fewer KV heads than ranks), so its ``Attention``
and KV cache see its heads only; o_proj and down_proj are row-parallel, so
each decoder layer does one all-reduce after the attention output and one
after the MLP; the embedding all-reduces its vocabulary slices and the
``LogitsProcessor`` all-gathers the logits for the sampler.

The batch is flat: ``forward(input_ids [T], positions [T]) -> [T, hidden]``
for the new tokens of every scheduled request, back to back. Tokens of
different requests meet only inside ``Attention``, which reads the step's
``AttentionMetadata`` from the forward context and the layer's paged KV
cache; everything else here is per token.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from mini_vllm.compilation.decorators import support_torch_compile
from mini_vllm.distributed.parallel_state import get_tensor_model_parallel_world_size
from mini_vllm.model_executor.layers.activation import SiluAndMul
from mini_vllm.model_executor.layers.attention import Attention
from mini_vllm.model_executor.layers.layernorm import RMSNorm
from mini_vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    divide,
)
from mini_vllm.model_executor.layers.logits_processor import LogitsProcessor
from mini_vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from mini_vllm.model_executor.layers.rotary_embedding import get_rope
from mini_vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)

# (fused parameter, checkpoint name it absorbs, which slice): see load_weights.
STACKED_PARAMS_MAPPING = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]


def rope_parameters(config: PretrainedConfig) -> dict:
    """RoPE's parameters: transformers 5 keeps theta in ``config.rope_parameters``;
    older configs had ``rope_theta``."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    return {"rope_type": "default", "rope_theta": getattr(config, "rope_theta", 10000.0)}


def extract_layer_index(prefix: str) -> int:
    """The one integer in a module name: ``"model.layers.3.self_attn"`` -> 3
    (upstream's helper of the same name, models/utils.py:738)."""
    ints = [int(part) for part in prefix.split(".") if part.isdigit()]
    if len(ints) != 1:
        raise ValueError(f"module name {prefix!r} should hold exactly one layer index")
    return ints[0]


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(
                f"Unsupported activation {hidden_act!r}: only 'silu' (SwiGLU) is supported"
            )
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias, quant_config, f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias, quant_config, f"{prefix}.down_proj"
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        prefix: str = "",
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        # Heads split over the tensor-parallel ranks (upstream :138-157); KV
        # heads too, or, fewer than the ranks, one a rank, shared.
        tp_size = get_tensor_model_parallel_world_size()
        self.total_num_heads = config.num_attention_heads
        self.num_heads = divide(self.total_num_heads, tp_size)
        self.total_num_kv_heads = (
            getattr(config, "num_key_value_heads", None) or self.total_num_heads
        )
        if self.total_num_kv_heads >= tp_size:
            divide(self.total_num_kv_heads, tp_size)
        else:
            divide(tp_size, self.total_num_kv_heads)
        self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)
        self.head_dim = (
            getattr(config, "head_dim", None) or self.hidden_size // self.total_num_heads
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        bias = bool(getattr(config, "attention_bias", False))

        self.qkv_proj = QKVParallelLinear(
            self.hidden_size,
            self.head_dim,
            self.total_num_heads,
            self.total_num_kv_heads,
            bias,
            quant_config,
            f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim,
            self.hidden_size,
            bias,
            quant_config,
            f"{prefix}.o_proj",
        )
        self.rotary_emb = get_rope(
            self.head_dim, config.max_position_embeddings, rope_parameters(config)
        )
        sliding_window = None
        if layer_types := getattr(config, "layer_types", None):
            if layer_types[extract_layer_index(prefix)] == "sliding_attention":
                sliding_window = config.sliding_window
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.scaling,
            self.num_kv_heads,
            prefix=f"{prefix}.attn",
            per_layer_sliding_window=sliding_window,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[nn.Module] = LlamaAttention

    def __init__(
        self,
        config: PretrainedConfig,
        prefix: str = "",
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(
            config, prefix=f"{prefix}.self_attn", quant_config=quant_config
        )
        self.mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            bias=bool(getattr(config, "mlp_bias", False)),
            quant_config=quant_config,
            prefix=f"{prefix}.mlp",
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream before it).

        Their sum is the new residual stream."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


# One trace for every batch size: the token dimension is dynamic (upstream :340-349).
@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "inputs_embeds": 0})
class LlamaModel(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_cls: type[nn.Module] = LlamaDecoderLayer,
        prefix: str = "model",
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, quant_config, f"{prefix}.embed_tokens"
        )
        self.layers = nn.ModuleList(
            layer_cls(config, prefix=f"{prefix}.layers.{i}", quant_config=quant_config)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``inputs_embeds`` [T, hidden], when given, replaces the embedding lookup
        (a multimodal model's merged text and image embeddings, Phase 13)."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        hidden_states = inputs_embeds
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    decoder_layer_cls: type[nn.Module] = LlamaDecoderLayer

    def __init__(
        self, config: PretrainedConfig, quant_config: QuantizationConfig | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.quant_config = quant_config
        self.model = LlamaModel(config, self.decoder_layer_cls, quant_config=quant_config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            # The output projection *is* the embedding table ([vocab, hidden]).
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(
                config.vocab_size, config.hidden_size, quant_config, prefix="lm_head"
            )
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [T] -> their embeddings [T, hidden] (upstream's ``embed_input_ids``)."""
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: int64 [T] (flat batch) -> hidden_states [T, hidden];
        ``inputs_embeds`` [T, hidden] instead of the ids' embeddings when given."""
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden] (the rows to sample from) -> logits [N, vocab]
        (every rank's vocabulary slice, gathered)."""
        return self.logits_processor(self.lm_head, hidden_states)

    def attention_layers(self) -> list[Attention]:
        """The Attention layers in layer order: one paged KV cache each."""
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors into the parameters; returns the parameter names filled.

        Every parameter (and every slice of a fused one) must be filled exactly
        once; a missing, duplicated, unknown or mis-shaped tensor raises
        ValueError naming it. ``lm_head.weight`` is ignored when the embeddings
        are tied, as are RoPE tables some checkpoints carry.
        """
        params = dict(self.named_parameters())
        # What must be filled, keyed "param" or "param[shard]" for the slices of
        # a fused one, each with the checkpoint name that fills it.
        expected: dict[str, str] = {}
        for name in params:
            fused_here = [
                (fused, ckpt, sid)
                for fused, ckpt, sid in STACKED_PARAMS_MAPPING
                if fused + "." in name
            ]
            for fused, ckpt, sid in fused_here:
                expected[f"{name}[{sid}]"] = name.replace(fused, ckpt)
            if not fused_here:
                expected[name] = name
        filled: set[str] = set()

        for ckpt_name, tensor in weights:
            if "rotary_emb." in ckpt_name:
                continue  # inv_freq / cos / sin tables: recomputed, never loaded
            if self.tie_word_embeddings and ckpt_name.startswith("lm_head."):
                continue
            name, shard_id = ckpt_name, None
            for param_suffix, ckpt_suffix, sid in STACKED_PARAMS_MAPPING:
                if ckpt_suffix + "." in ckpt_name:
                    name, shard_id = ckpt_name.replace(ckpt_suffix, param_suffix), sid
                    break
            if name not in params:
                raise ValueError(
                    f"checkpoint tensor {ckpt_name!r} matches no parameter of {type(self).__name__}"
                )
            key = name if shard_id is None else f"{name}[{shard_id}]"
            if key not in expected:
                raise ValueError(
                    f"checkpoint tensor {ckpt_name!r} is already fused; give the "
                    "unfused Hugging Face tensors (q_proj/k_proj/v_proj, gate_proj/up_proj)"
                )
            if key in filled:
                raise ValueError(f"checkpoint tensor {ckpt_name!r} appears twice")
            owner_name, _, param_name = name.rpartition(".")
            owner = self.get_submodule(owner_name)
            if hasattr(owner, "weight_loader"):  # linear and embedding layers
                owner.weight_loader(param_name, tensor, shard_id, ckpt_name)
            else:  # norms
                target = params[name].data
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(target.shape)}"
                    )
                with torch.no_grad():
                    target.copy_(tensor)
            filled.add(key)

        missing = sorted(expected[key] for key in expected.keys() - filled)
        if missing:
            shown = ", ".join(missing[:8]) + (
                f", ... ({len(missing)} in all)" if len(missing) > 8 else ""
            )
            raise ValueError(f"checkpoint is missing tensors for {type(self).__name__}: {shown}")
        return {key.split("[")[0] for key in filled}
