"""LLaVA: a CLIP vision tower, a two-layer projector, and a Llama that reads the result.

Mirrors upstream ``vllm/model_executor/models/llava.py`` at v0.22.1
(``LlavaMultiModalProjector`` at :128, ``_get_num_hidden_layers`` at :438,
``init_vision_tower_for_llava`` at :458, ``LlavaForConditionalGeneration``
at :504 with ``embed_multimodal`` at :661, ``forward`` at :668 and its
checkpoint-name mapper, hf_to_vllm_mapper at :517) and the merge of
``SupportsMultiModal.embed_input_ids`` (interfaces.py:374) with
``_merge_multimodal_embeddings`` (utils.py:456). Left out: SigLIP and
Pixtral towers, several feature layers, precomputed ``image_embeds`` inputs,
LoRA on the tower, tensor and pipeline parallelism, and the processor
registry (the processor is mini_vllm/multimodal/processing.py).

How an image reaches the language model:

1. the processor has already put ``N`` image tokens (``image_token_index``)
   in the prompt for each image, ``N`` being the number of patches the tower
   keeps, and made the image's ``pixel_values``;
2. ``embed_multimodal(pixel_values=[B, 3, H, W])`` runs the tower, keeps the
   second-to-last layer's patch vectors (``vision_feature_layer = -2``,
   ``"default"`` strategy: the class vector dropped) and projects them to the
   language model's width: ``[B, N, hidden]``, one row per image token;
3. ``embed_input_ids`` looks up every token's embedding and overwrites the
   rows at image-token positions (``is_multimodal``) with those image rows,
   in order;
4. the language model runs on those embeddings (``inputs_embeds``) exactly as
   it runs on text: positions, RoPE and the paged KV cache do not change.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import CLIPVisionConfig, PretrainedConfig

from mini_vllm.distributed.parallel_state import get_tensor_model_parallel_world_size
from mini_vllm.model_executor.layers.activation import get_act_fn
from mini_vllm.model_executor.layers.attention import Attention
from mini_vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from mini_vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from mini_vllm.model_executor.models.clip import CLIPVisionModel
from mini_vllm.model_executor.models.llama import LlamaForCausalLM

# Checkpoints saved by transformers >= 4.52 nest everything under "model."
# (upstream's hf_to_vllm_mapper, llava.py:517).
HF_TO_MINI_PREFIX = {
    "model.language_model.": "language_model.model.",
    "model.vision_tower.": "vision_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "lm_head.": "language_model.lm_head.",
}


def get_layer_index(feature_layer_index: int, num_hidden_layers: int) -> int:
    """How many tower layers are needed to read layer ``feature_layer_index``
    (negative: from the end), as upstream's helper (utils.py:868)."""
    if feature_layer_index < 0:
        return num_hidden_layers + feature_layer_index + 1
    return feature_layer_index


# BEGIN LAB 13.3: the encoder rows into the token embeddings, at the placeholders
def merge_multimodal_embeddings(
    inputs_embeds: torch.Tensor,
    multimodal_embeddings: list[torch.Tensor],
    is_multimodal: torch.Tensor,
) -> torch.Tensor:
    """Overwrite the rows of ``inputs_embeds`` [T, hidden] where ``is_multimodal``
    (bool [T]) is True with the rows of ``multimodal_embeddings`` (a list of
    [n_i, hidden]), in order; in place. Their counts must agree."""
    # HINT: nothing to merge: return inputs_embeds as it is. Else concatenate the
    # HINT: pieces; a count that differs from the mask's True positions is a ValueError
    # HINT: ("Attempted to assign ... multimodal tokens to ... placeholders"). The rows
    # HINT: take inputs_embeds' dtype; boolean-mask assignment fills them in order.
    if len(multimodal_embeddings) == 0:
        return inputs_embeds
    flat = torch.cat(list(multimodal_embeddings))
    num_expected = int(is_multimodal.sum())
    if flat.shape[0] != num_expected:
        raise ValueError(
            f"Attempted to assign {flat.shape[0]} multimodal tokens to {num_expected} placeholders"
        )
    inputs_embeds[is_multimodal.to(inputs_embeds.device)] = flat.to(inputs_embeds.dtype)
    return inputs_embeds


# END LAB 13.3


class LlavaMultiModalProjector(nn.Module):
    """vision width -> text width -> text width, with an activation between."""

    def __init__(
        self,
        vision_hidden_size: int,
        text_hidden_size: int,
        projector_hidden_act: str,
        multimodal_projector_bias: bool,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.linear_1 = ColumnParallelLinear(
            vision_hidden_size,
            text_hidden_size,
            multimodal_projector_bias,
            prefix=f"{prefix}.linear_1",
        )
        self.act = get_act_fn(projector_hidden_act)
        self.linear_2 = RowParallelLinear(
            text_hidden_size,
            text_hidden_size,
            multimodal_projector_bias,
            prefix=f"{prefix}.linear_2",
        )

    def forward(self, image_features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(image_features)))


class LlavaForConditionalGeneration(nn.Module):
    def __init__(
        self, config: PretrainedConfig, quant_config: QuantizationConfig | None = None
    ) -> None:
        super().__init__()
        self.config = config
        vision_config = config.vision_config
        if get_tensor_model_parallel_world_size() > 1:
            raise ValueError(
                "mini_vllm's LLaVA runs on one rank: use tensor_parallel_size=1 "
                "(its vision tower's attention is not split over ranks)"
            )
        if not isinstance(vision_config, CLIPVisionConfig):
            raise ValueError(
                f"vision_config is a {type(vision_config).__name__}: mini_vllm's LLaVA "
                "runs a CLIP vision tower only"
            )
        if not isinstance(config.vision_feature_layer, int):
            raise ValueError(
                f"vision_feature_layer {config.vision_feature_layer!r}: mini_vllm's LLaVA "
                "reads one feature layer (an int)"
            )
        # The tower is built only as deep as the layer the model reads.
        self.vision_tower = CLIPVisionModel(
            vision_config,
            num_hidden_layers_override=get_layer_index(
                config.vision_feature_layer, vision_config.num_hidden_layers
            ),
            require_post_norm=False,
            prefix="vision_tower",
        )
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision_config.hidden_size,
            config.text_config.hidden_size,
            config.projector_hidden_act,
            bool(getattr(config, "multimodal_projector_bias", True)),
            prefix="multi_modal_projector",
        )
        # The tower and projector stay in full precision; only the language
        # model takes a quantization config.
        self.language_model = LlamaForCausalLM(config.text_config, quant_config)

    # ------------------------------------------------------------ the image side

    def embed_multimodal(self, pixel_values: torch.Tensor | None = None) -> list[torch.Tensor]:
        """pixel_values [B, C, H, W] -> one [N, hidden] tensor per image (the
        language model's width); [] without images."""
        if pixel_values is None:
            return []
        size = self.config.vision_config.image_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (
            self.config.vision_config.num_channels,
            size,
            size,
        ):
            raise ValueError(
                f"pixel_values has shape {tuple(pixel_values.shape)}, expected "
                f"[B, {self.config.vision_config.num_channels}, {size}, {size}]"
            )
        image_features = self.vision_tower(
            pixel_values, feature_select_strategy=self.config.vision_feature_select_strategy
        )
        return list(self.multi_modal_projector(image_features))

    # upstream's name before it became embed_multimodal
    get_multimodal_embeddings = embed_multimodal

    def embed_input_ids(
        self,
        input_ids: torch.Tensor,
        multimodal_embeddings: list[torch.Tensor] | None = None,
        is_multimodal: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every token's embedding [T, hidden], image rows merged in where
        ``is_multimodal`` says (image-token ids are in the vocabulary: their own
        embedding rows are looked up, then overwritten)."""
        inputs_embeds = self.language_model.embed_input_ids(input_ids)
        if multimodal_embeddings is None or is_multimodal is None:
            return inputs_embeds
        return merge_multimodal_embeddings(inputs_embeds, multimodal_embeddings, is_multimodal)

    # ----------------------------------------------------------- the text side

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As LlamaForCausalLM's: the runner passes ``inputs_embeds`` with the
        images merged in (``embed_input_ids``)."""
        return self.language_model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)

    def attention_layers(self) -> list[Attention]:
        return self.language_model.attention_layers()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Hugging Face names (old or new layout) routed to the tower, the
        projector or the language model, whose own loader checks its tensors.
        Every parameter must be filled: ValueError naming the first missing one."""
        text: list[tuple[str, torch.Tensor]] = []
        tower: list[tuple[str, torch.Tensor]] = []
        projector = dict(self.multi_modal_projector.named_parameters())
        filled: set[str] = set()
        for name, tensor in weights:
            for old, new in HF_TO_MINI_PREFIX.items():
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
            if name.startswith("language_model."):
                text.append((name[len("language_model.") :], tensor))
            elif name.startswith("vision_tower.vision_model."):
                tower.append((name[len("vision_tower.vision_model.") :], tensor))
            elif name.startswith("vision_tower."):  # new layout: no "vision_model."
                tower.append((name[len("vision_tower.") :], tensor))
            elif name.startswith("multi_modal_projector."):
                short = name[len("multi_modal_projector.") :]
                if short not in projector:
                    raise ValueError(f"checkpoint tensor {name!r} matches no projector parameter")
                layer_name, _, param_name = short.rpartition(".")
                layer = self.multi_modal_projector.get_submodule(layer_name)
                layer.weight_loader(param_name, tensor, None, name)
                filled.add(name)
            else:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of LLaVA")
        filled |= {f"language_model.{n}" for n in self.language_model.load_weights(text)}
        filled |= {f"vision_tower.{n}" for n in self.vision_tower.load_weights(tower)}
        missing = sorted(n for n, _ in self.named_parameters() if n not in filled)
        if missing:
            raise ValueError(f"checkpoint is missing tensors for LLaVA: {', '.join(missing[:8])}")
        return filled
