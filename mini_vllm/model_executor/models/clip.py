"""CLIP's vision tower: an image cut into patches, run through a bidirectional transformer.

Mirrors upstream ``vllm/model_executor/models/clip.py`` at v0.22.1
(``CLIPVisionEmbeddings`` at :311, ``CLIPAttention`` at :354, ``CLIPMLP`` at
:421, ``CLIPEncoderLayer`` at :459, ``CLIPEncoder`` at :499,
``CLIPVisionTransformer`` at :635, ``CLIPVisionModel`` at :755) and the
feature selection of ``resolve_visual_encoder_outputs``
(vllm/model_executor/models/vision.py:198). Left out: CLIP's text tower and
the CLIP embedding model, several selected layers (``select_layers``),
tensor and data parallelism (the layers are upstream's parallel ones, but
the attention takes all heads: LLaVA refuses ``tensor_parallel_size > 1``),
quantization, and upstream's choice of attention backend
(``MMEncoderAttention``): attention here is torch's SDPA.

An image ``[3, image_size, image_size]`` becomes ``(image_size /
patch_size)**2`` patch vectors (one strided convolution), with a learned
class vector in front and a learned position vector added to each. The
encoder layers are pre-norm with LayerNorm, every position attends to every
other one (no causal mask, no KV cache: an image is encoded whole, once),
and the MLP uses CLIP's ``quick_gelu``. LLaVA reads the output of the
second-to-last layer, so the tower is built only that deep
(``num_hidden_layers_override``) and without its final LayerNorm.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import CLIPVisionConfig

from mini_vllm.model_executor.layers.activation import get_act_fn
from mini_vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)


def select_features(features: torch.Tensor, strategy: str) -> torch.Tensor:
    """Which of the tower's output vectors the model keeps ([B, 1 + patches, D] in):
    ``"default"`` drops the class vector, ``"full"`` keeps all, ``"class"`` keeps
    only it (upstream's ``_get_vision_feature_selector``, vision.py:148)."""
    if strategy == "default":
        return features[:, 1:]
    if strategy == "full":
        return features
    if strategy == "class":
        return features[:, :1]
    raise ValueError(f"Unexpected vision_feature_select_strategy {strategy!r}")


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        self.embed_dim = config.hidden_size
        self.image_size = config.image_size
        self.patch_size = config.patch_size
        if self.image_size % self.patch_size:
            raise ValueError(
                f"vision_config.image_size {self.image_size} is not a multiple of "
                f"patch_size {self.patch_size}"
            )
        self.class_embedding = nn.Parameter(torch.empty(self.embed_dim))
        # One patch -> one vector: a convolution whose stride is its kernel.
        self.patch_embedding = nn.Conv2d(
            config.num_channels,
            self.embed_dim,
            kernel_size=self.patch_size,
            stride=self.patch_size,
            bias=False,
        )
        self.num_patches = (self.image_size // self.patch_size) ** 2
        self.num_positions = self.num_patches + 1
        self.position_embedding = nn.Embedding(self.num_positions, self.embed_dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [B, C, H, W] -> [B, 1 + patches, D]."""
        batch_size = pixel_values.shape[0]
        weight = self.patch_embedding.weight
        patch_embeds = self.patch_embedding(pixel_values.to(weight.dtype))  # [B, D, g, g]
        patch_embeds = patch_embeds.flatten(2).transpose(1, 2)  # [B, g*g, D], row-major
        class_embeds = self.class_embedding.expand(batch_size, 1, -1)
        embeddings = torch.cat([class_embeds, patch_embeds], dim=1)
        return embeddings + self.position_embedding.weight


class CLIPAttention(nn.Module):
    """Multi-head self-attention over all of an image's positions (no mask)."""

    def __init__(self, config: CLIPVisionConfig, prefix: str = "") -> None:
        super().__init__()
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        if self.head_dim * self.num_heads != self.embed_dim:
            raise ValueError(
                f"vision_config.hidden_size {self.embed_dim} is not a multiple of "
                f"num_attention_heads {self.num_heads}"
            )
        self.scale = self.head_dim**-0.5
        self.qkv_proj = QKVParallelLinear(
            self.embed_dim,
            self.head_dim,
            self.num_heads,
            self.num_heads,
            bias=True,
            prefix=f"{prefix}.qkv_proj",
        )
        self.out_proj = RowParallelLinear(
            self.embed_dim, self.embed_dim, bias=True, prefix=f"{prefix}.out_proj"
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[B, S, D] -> [B, S, D]."""
        batch, seq, _ = hidden_states.shape
        q, k, v = self.qkv_proj(hidden_states).chunk(3, dim=-1)

        def heads(x: torch.Tensor) -> torch.Tensor:  # [B, S, D] -> [B, H, S, head_dim]
            return x.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), scale=self.scale)
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq, self.embed_dim))


class CLIPMLP(nn.Module):
    def __init__(self, config: CLIPVisionConfig, prefix: str = "") -> None:
        super().__init__()
        self.activation_fn = get_act_fn(config.hidden_act)
        self.fc1 = ColumnParallelLinear(
            config.hidden_size, config.intermediate_size, bias=True, prefix=f"{prefix}.fc1"
        )
        self.fc2 = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=True, prefix=f"{prefix}.fc2"
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation_fn(self.fc1(hidden_states)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config: CLIPVisionConfig, prefix: str = "") -> None:
        super().__init__()
        self.self_attn = CLIPAttention(config, prefix=f"{prefix}.self_attn")
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config, prefix=f"{prefix}.mlp")
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.layer_norm1(hidden_states))
        return hidden_states + self.mlp(self.layer_norm2(hidden_states))


class CLIPEncoder(nn.Module):
    def __init__(self, config: CLIPVisionConfig, num_hidden_layers: int, prefix: str = "") -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            CLIPEncoderLayer(config, prefix=f"{prefix}.layers.{i}")
            for i in range(num_hidden_layers)
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states


class CLIPVisionTransformer(nn.Module):
    def __init__(
        self,
        config: CLIPVisionConfig,
        num_hidden_layers_override: int | None = None,
        require_post_norm: bool | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.config = config
        num_layers = config.num_hidden_layers
        if num_hidden_layers_override is not None:
            if num_hidden_layers_override > num_layers:
                raise ValueError(
                    f"the vision tower has {num_layers} layers, but "
                    f"{num_hidden_layers_override} were requested"
                )
            num_layers = num_hidden_layers_override
        self.embeddings = CLIPVisionEmbeddings(config)
        # "layrnorm": the checkpoint's own spelling, kept so names match.
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = CLIPEncoder(config, num_layers, prefix=f"{prefix}.encoder")
        if require_post_norm is None:
            require_post_norm = num_layers == config.num_hidden_layers
        self.post_layernorm = (
            nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
            if require_post_norm
            else None
        )

    def forward(
        self, pixel_values: torch.Tensor, feature_select_strategy: str | None = None
    ) -> torch.Tensor:
        """pixel_values [B, C, H, W] -> the last built layer's output, selected, [B, S, D]."""
        hidden_states = self.pre_layrnorm(self.embeddings(pixel_values))
        hidden_states = self.encoder(hidden_states)
        if feature_select_strategy is not None:
            hidden_states = select_features(hidden_states, feature_select_strategy)
        if self.post_layernorm is not None:
            hidden_states = self.post_layernorm(hidden_states)
        return hidden_states


class CLIPVisionModel(nn.Module):
    """The tower as checkpoints name it: everything under ``vision_model.``."""

    def __init__(
        self,
        config: CLIPVisionConfig,
        num_hidden_layers_override: int | None = None,
        require_post_norm: bool | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.vision_model = CLIPVisionTransformer(
            config, num_hidden_layers_override, require_post_norm, prefix=f"{prefix}.vision_model"
        )

    def forward(
        self, pixel_values: torch.Tensor, feature_select_strategy: str | None = None
    ) -> torch.Tensor:
        return self.vision_model(pixel_values, feature_select_strategy)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Hugging Face names relative to the tower (``embeddings.``, ``encoder.layers.N.``,
        ...): q/k/v go into ``qkv_proj``; layers past the ones built and an unused
        ``post_layernorm`` are skipped, as upstream's ``CLIPVisionTransformer.load_weights``
        (:716). Returns the parameter names filled."""
        tower = self.vision_model
        params = dict(tower.named_parameters())
        num_layers = len(tower.encoder.layers)
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("post_layernorm") and tower.post_layernorm is None:
                continue
            if name.startswith("encoder.layers.") and int(name.split(".")[2]) >= num_layers:
                continue
            shard_id = None
            for proj in ("q", "k", "v"):
                if f".{proj}_proj." in name:
                    name, shard_id = name.replace(f".{proj}_proj.", ".qkv_proj."), proj
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} matches no vision tower parameter")
            owner_name, _, param_name = name.rpartition(".")
            owner = tower.get_submodule(owner_name)
            if hasattr(owner, "weight_loader"):  # the linear layers
                owner.weight_loader(param_name, tensor, shard_id, name)
            else:
                target = params[name].data
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(target.shape)}"
                    )
                with torch.no_grad():
                    target.copy_(tensor)
            loaded.add(f"vision_model.{name}")
        return loaded
