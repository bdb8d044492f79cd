"""``python -m mini_vllm.benchmarks.multimodal`` runs, at a tiny setting.

The tiny seeded LLaVA, three requests sent together: with one image each the
encoder runs three times, with one shared image once (the encoder cache); the
step timer sees one prefill step that encodes them all and a decode-only
step per further token. ``flop_share`` counts what the model's own linear
layers hold.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlavaForConditionalGeneration

from mini_vllm.benchmarks import multimodal
from mini_vllm.model_executor.model_loader.tiny_llava import TINY_IMAGE_TOKENS
from mini_vllm.testing import make_tiny_llava


# one engine, two small generate calls and a warm-up: ~9 s on 2 busy cores
def test_the_benchmark_runs_at_a_tiny_setting(tmp_path):
    argv = ["--configs", "tiny", "--num-requests", "3", "--shared-images", "1"]
    argv += ["--output-len", "3", "--reps", "1", "--out", str(tmp_path / "out")]
    report = multimodal.main(argv)
    saved = json.loads((tmp_path / "out" / "multimodal_cpu.json").read_text())
    assert saved == json.loads(json.dumps(report))
    assert report["torch_threads"] == 1
    [tiny] = report["configs"]
    assert tiny["image_tokens"] == TINY_IMAGE_TOKENS
    distinct, shared = tiny["medians"]["distinct"], tiny["medians"]["shared"]
    assert distinct["encoder_runs"] == 3 and shared["encoder_runs"] == 1
    for case in (distinct, shared):
        assert 0 < case["encoder_s"] and 0 < case["decoder_s"] < case["wall_s"]
        assert 0 < case["ttft_median_s"] < case["wall_s"]
    [run] = tiny["runs"]["distinct"]
    assert run["num_steps"] == 3  # the prefill of all three, then two decode steps
    p = tiny["per_step"]
    assert (p["encoding_steps"], p["images_per_encoding_step_median"], p["decode_steps"]) == (
        1,
        3,
        2,
    )
    assert p["encoder_s_per_image_median"] == pytest.approx(p["encoder_s_median"] / 3)
    assert 0 < p["encoder_share_of_encoder_plus_decoder"] < 1


def test_flop_share_counts_the_models_linear_layers(tmp_path):
    """The encoder's share from the config equals the one counted from the
    weights of transformers' LLaVA: the tower's layers but the last over
    patches + 1 rows, the projector over the patches, against the language
    model's layers over the patches."""
    folder = make_tiny_llava(tmp_path / "tiny", seed=0)
    model = LlavaForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32)
    config = model.config
    patches = TINY_IMAGE_TOKENS
    last = config.vision_config.num_hidden_layers - 1
    vision = projector = text = 0
    for name, param in model.named_parameters():
        if param.dim() != 2 or "embed" in name or "lm_head" in name:
            continue
        if ".encoder.layers." in name:
            if int(name.split(".encoder.layers.")[1].split(".")[0]) != last:
                vision += param.numel()
        elif "multi_modal_projector" in name:
            projector += param.numel()
        elif ".layers." in name:
            text += param.numel()
    encoder = vision * (patches + 1) + projector * patches
    expected = encoder / (encoder + text * patches)
    sizes = {
        "vision": config.vision_config.to_dict(),
        "text": config.text_config.to_dict(),
        "image_size": config.vision_config.image_size,
        "patch_size": config.vision_config.patch_size,
    }
    assert multimodal.flop_share(sizes) == pytest.approx(expected)
