"""Turn a prompt and its images into placeholder tokens, pixel values and features.

Mirrors, for LLaVA only, what upstream's ``BaseMultiModalProcessor.apply``
(vllm/multimodal/processing/processor.py) does with
``LlavaMultiModalProcessor`` (vllm/model_executor/models/llava.py:308; its
prompt update ``_get_prompt_updates`` at :274 and the token count
``get_num_image_tokens`` at :188 with ``CLIPEncoderInfo`` at clip.py:83):
each image token in the prompt is replaced by as many image tokens as the
vision tower yields embeddings, and each image becomes one
``MultiModalFeatureSpec``. Left out: other models and modalities, the
processor cache, user-given ``multi_modal_uuids``, precomputed image
embeddings, and detecting prompts the Hugging Face processor already
expanded.

For ``"USER: <image>\\nWhat is this?"`` with one image and a tower keeping 16
patch vectors, the prompt's one ``<image>`` id becomes 16 of them starting at
its position ``p``; the image's feature records ``PlaceholderRange(p, 16)``,
its ``pixel_values`` (made by the checkpoint's own image processor: resize,
crop, normalize, as upstream calls the Hugging Face processor) and its hash
(``MultiModalHasher``): requests that carry the same pixels share that hash,
so the encoder runs once for them and their cached KV blocks can match.

Checks, each a ``ValueError`` naming what is wrong: a value under
``multi_modal_data["image"]`` that is not a PIL image; a modality other than
``"image"``; a number of ``<image>`` tokens in the prompt that differs from the
number of images (upstream's ``_validate_mm_updates``, processor.py:1600,
raises RuntimeError with the same count).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from PIL import Image
from transformers import AutoImageProcessor, PretrainedConfig

from mini_vllm.multimodal.hasher import MultiModalHasher
from mini_vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange


@dataclass
class MultiModalInputs:
    """A processed prompt: its token ids, placeholders expanded, and one feature per image."""

    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeatureSpec]


def parse_images(multi_modal_data: object) -> list[Image.Image]:
    """``{"image": img}`` or ``{"image": [img, ...]}`` -> the images, checked."""
    if not isinstance(multi_modal_data, dict):
        raise ValueError(
            "multi_modal_data must be a dict like {'image': <PIL image or list of them>}, "
            f"got {type(multi_modal_data).__name__}"
        )
    unknown = sorted(set(multi_modal_data) - {"image"})
    if unknown:
        raise ValueError(f"multi_modal_data: unsupported modality {unknown[0]!r} (only 'image')")
    images = multi_modal_data.get("image", [])
    if not isinstance(images, (list, tuple)):
        images = [images]
    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise ValueError(
                f"multi_modal_data['image'][{i}] is not an image: expected a PIL.Image.Image, "
                f"got {type(image).__name__}"
            )
    return list(images)


class LlavaMultiModalProcessor:
    def __init__(self, hf_config: PretrainedConfig, image_processor, model_id: str) -> None:
        self.hf_config = hf_config
        self.image_processor = image_processor
        self.model_id = model_id
        self.image_token_id = int(hf_config.image_token_index)

    @classmethod
    def from_pretrained(cls, path: str | Path, hf_config: PretrainedConfig):
        """The processor for a checkpoint folder (its ``preprocessor_config.json``
        or ``processor_config.json`` gives the image processor)."""
        image_processor = AutoImageProcessor.from_pretrained(str(path))
        return cls(hf_config, image_processor, str(path))

    def get_num_image_tokens(self) -> int:
        """Embeddings one image fills: CLIP's patches plus its class vector, less
        what the feature strategy drops. Every image is resized to the tower's
        size, so the count does not depend on the image."""
        vision = self.hf_config.vision_config
        num_tokens = (vision.image_size // vision.patch_size) ** 2 + 1
        strategy = self.hf_config.vision_feature_select_strategy
        if strategy == "default":
            return num_tokens - 1
        if strategy == "full":
            return num_tokens
        raise ValueError(f"Unexpected vision_feature_select_strategy {strategy!r}")

    def apply(self, prompt_token_ids: list[int], multi_modal_data: object) -> MultiModalInputs:
        images = parse_images(multi_modal_data)
        image_positions = [i for i, t in enumerate(prompt_token_ids) if t == self.image_token_id]
        if len(image_positions) != len(images):
            raise ValueError(
                f"the prompt has {len(image_positions)} image placeholder token(s) "
                f"(id {self.image_token_id}) for {len(images)} image(s): put one image "
                "token (e.g. '<image>') in the prompt for each image"
            )
        n = self.get_num_image_tokens()
        token_ids: list[int] = []
        features: list[MultiModalFeatureSpec] = []
        start = 0
        for image, pos in zip(images, image_positions, strict=True):
            token_ids.extend(prompt_token_ids[start:pos])
            placeholder = PlaceholderRange(offset=len(token_ids), length=n)
            token_ids.extend([self.image_token_id] * n)
            start = pos + 1
            pixel_values = self.image_processor(images=[image], return_tensors="pt")[
                "pixel_values"
            ][0]
            mm_hash = MultiModalHasher.hash_kwargs(model_id=self.model_id, image=image)
            features.append(
                MultiModalFeatureSpec(
                    data={"pixel_values": pixel_values},
                    modality="image",
                    identifier=mm_hash,
                    mm_position=placeholder,
                    mm_hash=mm_hash,
                )
            )
        token_ids.extend(prompt_token_ids[start:])
        return MultiModalInputs(token_ids, features)
