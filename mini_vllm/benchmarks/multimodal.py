"""Multimodal measured: encoder against decoder time per step; what the encoder cache saves.

``python -m mini_vllm.benchmarks.multimodal [--configs tiny clip-l-share]
[--num-requests N] [--shared-images K] [--output-len M] [--reps R] [--out DIR]``

Two seeded LLaVA checkpoints (CLIP tower + projector + Llama, random
weights: the cost of a step does not depend on what the weights are), built
in a temporary folder at the start:

- ``tiny``: ``mini_vllm.testing.make_tiny_llava`` (32 x 32 images, 16 image
  tokens, a 2-layer tower of width 32 read, a 3-layer Llama of width 64).
- ``clip-l-share``: the encoder's share of an image's FLOPs set to that of
  LLaVA-1.5-7B (CLIP ViT-L/14 at 336 px, 23 of its 24 layers read, width
  1024, and a 2-layer projector, against Vicuna-7B's 32 layers of width 4096:
  the encoder is about 4.6% of the linear-layer FLOPs of encoding an image
  and prefilling its 576 placeholders), at sizes that run on 2 busy CPU
  cores: a 6-layer tower of width 128 (5 read) and an 8-layer Llama of
  SmolLM2-135M's width (576, 9 query / 3 KV heads), on 224 px images with
  14 px patches (CLIP-L/14 at 224 px, LLaVA-1's tower: 256 image tokens;
  336 px made one run take 2 minutes). The share is per image token, so the
  image size barely moves it; ``flop_share`` in the report gives both, from
  the configs.

Timing: the engine runs in this process; the benchmark wraps the runner's
``_execute_mm_encoder`` (the encoder: CLIP tower and projector over the
step's scheduled images, in one batch) and the language model's ``forward``
(the decoder layers only; the embedding lookup, logits and sampling are in
neither) and records, per ``execute_model`` step, the seconds of each, the
images encoded and the tokens scheduled. Nothing in the runner changes.

Workloads, each ``--num-requests`` requests ``"USER: <image>\\nWhat is in
the picture? ASSISTANT:"`` sent together in one ``generate`` (greedy,
``--output-len`` tokens, EOS ignored), prefix caching off (else a repeated
image and prompt would skip the prefill too, and the encoder with it):

- ``distinct``: every request has its own image;
- ``shared``: ``--shared-images`` images, request i takes image i mod K.

Each repetition draws new random images (the encoder cache keeps unreferenced
entries until it needs the room, so a repeated image would hit the previous
repetition's entries), and runs distinct and shared back to back (in turn
first), so that the machine's load changes hit both alike. One torch thread
by default (``--threads``): on 2 cores shared with other work, two threads
stall on each other at every operator. Reported, medians over the
repetitions: encoder runs (images encoded), encoder seconds, decoder
seconds, wall seconds and this process's CPU seconds for the ``generate``,
the requests' median TTFT (first token time - arrival time, RequestMetrics);
the distinct / shared ratios, and the wall ratio expected if the encoder
seconds saved were the only difference (what the load's noise hides or not);
and per step, from the distinct runs: a step that encodes (its encoder and
decoder seconds, and their ratio), a decode-only step's decoder seconds, and
one image's encoder seconds against a decode step.

Writes ``OUT/multimodal_cpu.json`` and prints markdown tables, with the CPU
count, torch threads and the 1-minute load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")  # before torch imports tqdm
import numpy as np  # noqa: E402
import torch  # noqa: E402

DEFAULT_OUT = Path(__file__).parent / "results"
PROMPT = "USER: <image>\nWhat is in the picture? ASSISTANT:"

# LLaVA-1.5-7B (llava-hf/llava-1.5-7b-hf's config.json): the shape whose
# encoder share ``clip-l-share`` copies.
LLAVA_15_7B = {
    "vision": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24},
    "text": {
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
    },
    "image_size": 336,
    "patch_size": 14,
}
CLIP_L_SHARE = {
    "vision": {
        "hidden_size": 128,
        "intermediate_size": 512,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
    },
    "text": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "max_position_embeddings": 2048,
    },
    "image_size": 224,
    "patch_size": 14,
}


def flop_share(sizes: dict) -> float:
    """The encoder's share of the linear-layer FLOPs of one image: the tower's
    layers read (all but the last: vision_feature_layer -2) over its patches
    plus the class vector, the projector over the patches, against the
    language model's layers over the patches (its placeholders)."""
    v, t = sizes["vision"], sizes["text"]
    patches = (sizes["image_size"] // sizes["patch_size"]) ** 2
    vd, td = v["hidden_size"], t["hidden_size"]
    vision_layer = 4 * vd * vd + 2 * vd * v["intermediate_size"]
    encoder = (v["num_hidden_layers"] - 1) * vision_layer * (patches + 1)
    encoder += (vd * td + td * td) * patches  # projector
    kv = td * t["num_key_value_heads"] // t["num_attention_heads"]
    text_layer = td * (2 * td + 2 * kv) + 3 * td * t["intermediate_size"]
    decoder = t["num_hidden_layers"] * text_layer * patches
    return encoder / (encoder + decoder)


def make_seeded_llava(out_dir: Path, sizes: dict, seed: int = 0) -> Path:
    """A seeded LLaVA of the given sizes (tiny_llava.py's layout and tokenizer)."""
    from transformers import CLIPImageProcessorPil, LlavaForConditionalGeneration, LlavaProcessor

    from mini_vllm.model_executor.model_loader.tiny_llava import (
        IMAGE_TOKEN,
        _smollm2_tokenizer,
        tiny_llava_config,
    )

    tok = _smollm2_tokenizer()
    config = tiny_llava_config(len(tok), tok.convert_tokens_to_ids(IMAGE_TOKEN), tok)
    image_size, patch_size = sizes["image_size"], sizes["patch_size"]
    vision = {**sizes["vision"], "image_size": image_size, "patch_size": patch_size}
    for key, value in vision.items():
        setattr(config.vision_config, key, value)
    text = sizes["text"]
    for key, value in text.items():
        setattr(config.text_config, key, value)
    config.text_config.head_dim = text["hidden_size"] // text["num_attention_heads"]
    config.image_seq_length = (image_size // patch_size) ** 2
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(config).to(torch.float32).save_pretrained(str(out_dir))
    LlavaProcessor(
        image_processor=CLIPImageProcessorPil(
            size={"shortest_edge": image_size},
            crop_size={"height": image_size, "width": image_size},
        ),
        tokenizer=tok,
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token=IMAGE_TOKEN,
    ).save_pretrained(str(out_dir))
    return out_dir


class StepTimer:
    """Per-step encoder and decoder seconds, by wrapping the runner's methods."""

    def __init__(self, runner) -> None:
        self.steps: list[dict] = []
        execute_model, encode = runner.execute_model, runner._execute_mm_encoder
        forward = runner.model.forward

        def timed_execute_model(scheduler_output, *args, **kwargs):
            self.steps.append(
                {
                    "tokens": scheduler_output.total_num_scheduled_tokens,
                    "images": 0,
                    "encoder_s": 0.0,
                    "decoder_s": 0.0,
                }
            )
            return execute_model(scheduler_output, *args, **kwargs)

        def timed_encode(scheduler_output):
            start = time.perf_counter()
            outputs = encode(scheduler_output)
            self.steps[-1]["encoder_s"] += time.perf_counter() - start
            self.steps[-1]["images"] += len(outputs)
            return outputs

        def timed_forward(*args, **kwargs):
            start = time.perf_counter()
            out = forward(*args, **kwargs)
            self.steps[-1]["decoder_s"] += time.perf_counter() - start
            return out

        runner.execute_model = timed_execute_model
        runner._execute_mm_encoder = timed_encode
        runner.model.forward = timed_forward  # nn.Module.__call__ looks it up on the instance


def random_image(rng: np.random.RandomState, size: int):
    from PIL import Image

    return Image.fromarray(rng.randint(0, 256, size=(size, size, 3), dtype=np.uint8))


def run_workload(llm, timer: StepTimer, images: list, n: int, output_len: int) -> dict:
    from mini_vllm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    prompts = [
        {"prompt": PROMPT, "multi_modal_data": {"image": images[i % len(images)]}} for i in range(n)
    ]
    first = len(timer.steps)
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    steps = timer.steps[first:]
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    return {
        "encoder_runs": sum(s["images"] for s in steps),
        "encoder_s": sum(s["encoder_s"] for s in steps),
        "decoder_s": sum(s["decoder_s"] for s in steps),
        "wall_s": wall,
        "cpu_s": cpu,
        "ttft_median_s": statistics.median(ttft),
        "steps": steps,
    }


def bench_config(name: str, folder: str, args) -> dict:
    from transformers import AutoConfig

    from mini_vllm.entrypoints.llm import LLM

    hf = AutoConfig.from_pretrained(folder)
    image_size = hf.vision_config.image_size
    llm = LLM(folder, enable_prefix_caching=False)
    runner = llm.llm_engine.engine_core.model_runner
    timer = StepTimer(runner)
    rng = np.random.RandomState(0)
    n, k = args.num_requests, args.shared_images
    # One-off costs (first calls into each kernel), not timed.
    run_workload(llm, timer, [random_image(rng, image_size)], 2, 2)
    runs: dict[str, list[dict]] = {"distinct": [], "shared": []}
    for rep in range(args.reps):
        images = {
            "distinct": [random_image(rng, image_size) for _ in range(n)],
            "shared": [random_image(rng, image_size) for _ in range(k)],
        }
        for case in ("distinct", "shared") if rep % 2 == 0 else ("shared", "distinct"):
            runs[case].append(run_workload(llm, timer, images[case], n, args.output_len))
    keys = ("encoder_runs", "encoder_s", "decoder_s", "wall_s", "cpu_s", "ttft_median_s")
    medians = {
        case: {key: statistics.median(r[key] for r in rs) for key in keys}
        for case, rs in runs.items()
    }
    d, s = medians["distinct"], medians["shared"]
    saved = {
        key: d[key] / s[key] if s[key] else None
        for key in ("encoder_s", "wall_s", "cpu_s", "ttft_median_s")
    }
    # The wall ratio if the encoder seconds saved were the only difference.
    saved["wall_s_expected"] = d["wall_s"] / (d["wall_s"] - (d["encoder_s"] - s["encoder_s"]))
    # Per step, over every distinct run's steps.
    all_steps = [step for r in runs["distinct"] for step in r["steps"]]
    encoding = [step for step in all_steps if step["images"]]
    decode_only = [step for step in all_steps if not step["images"] and step["tokens"] <= n]
    encoder_step_s = statistics.median(step["encoder_s"] for step in encoding)
    decoder_in_encoding_step_s = statistics.median(step["decoder_s"] for step in encoding)
    decode_step_s = statistics.median(step["decoder_s"] for step in decode_only)
    per_image_s = statistics.median(step["encoder_s"] / step["images"] for step in encoding)
    sizes = {
        "vision": {
            key: getattr(hf.vision_config, key)
            for key in ("hidden_size", "intermediate_size", "num_hidden_layers")
        },
        "text": {
            key: getattr(hf.text_config, key)
            for key in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
            )
        },
        "image_size": image_size,
        "patch_size": hf.vision_config.patch_size,
    }
    for r in runs["distinct"] + runs["shared"]:
        r["num_steps"] = len(r.pop("steps"))
    return {
        "name": name,
        "sizes": sizes,
        "image_tokens": (image_size // sizes["patch_size"]) ** 2,
        "flop_share": flop_share(sizes),
        "medians": medians,
        "distinct_over_shared": saved,
        "per_step": {
            "encoding_steps": len(encoding),
            "images_per_encoding_step_median": statistics.median(s["images"] for s in encoding),
            "encoder_s_median": encoder_step_s,
            "decoder_s_in_encoding_step_median": decoder_in_encoding_step_s,
            "encoder_over_decoder_in_encoding_step": encoder_step_s / decoder_in_encoding_step_s,
            "decode_steps": len(decode_only),
            "decode_step_decoder_s_median": decode_step_s,
            "encoder_s_per_image_median": per_image_s,
            "one_image_over_decode_step": per_image_s / decode_step_s,
            "encoder_share_of_encoder_plus_decoder": d["encoder_s"]
            / (d["encoder_s"] + d["decoder_s"]),
        },
        "runs": runs,
    }


def markdown(report: dict) -> str:
    lines = [
        f"{report['num_requests']} requests sent together, {report['output_len']} output "
        f"tokens, prefix caching off; distinct = one image a request, shared = "
        f"{report['shared_images']} images; medians of {report['reps']} repetitions:",
        "",
        "| model | case | encoder runs | encoder s | decoder s | wall s | CPU s | TTFT ms |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in report["configs"]:
        for case in ("distinct", "shared"):
            m = c["medians"][case]
            lines.append(
                f"| {c['name']} | {case} | {m['encoder_runs']:.0f} | {m['encoder_s']:.3f} | "
                f"{m['decoder_s']:.3f} | {m['wall_s']:.2f} | {m['cpu_s']:.2f} | "
                f"{1e3 * m['ttft_median_s']:.0f} |"
            )
        x = c["distinct_over_shared"]
        lines.append(
            f"| {c['name']} | distinct / shared | | {x['encoder_s']:.2f}x | | "
            f"{x['wall_s']:.2f}x (expected {x['wall_s_expected']:.2f}x) | {x['cpu_s']:.2f}x | "
            f"{x['ttft_median_s']:.2f}x |"
        )
    lines += [
        "",
        "Per step (distinct runs): a step that encodes, and a decode-only step:",
        "",
        "| model | image tokens | FLOP share | images/step | encoder ms | decoder ms "
        "| enc/dec | decode step ms | one image / decode step | encoder share |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in report["configs"]:
        p = c["per_step"]
        lines.append(
            f"| {c['name']} | {c['image_tokens']} | {100 * c['flop_share']:.1f}% | "
            f"{p['images_per_encoding_step_median']:.0f} | {1e3 * p['encoder_s_median']:.1f} | "
            f"{1e3 * p['decoder_s_in_encoding_step_median']:.1f} | "
            f"{p['encoder_over_decoder_in_encoding_step']:.3f} | "
            f"{1e3 * p['decode_step_decoder_s_median']:.2f} | "
            f"{p['one_image_over_decode_step']:.1f}x | "
            f"{100 * p['encoder_share_of_encoder_plus_decoder']:.1f}% |"
        )
    lines += [
        "",
        "LLaVA-1.5-7B's FLOP share, for comparison: "
        f"{100 * report['llava_15_7b_flop_share']:.1f}%.",
        f"CPUs {report['cpus']}, torch threads {report['torch_threads']}, load average "
        f"{report['load_average_1m']:.2f} before the run, {report['load_average_1m_after']:.2f} "
        f"after; {report['seconds']:.0f} s in all.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from mini_vllm.testing import make_tiny_llava

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--configs", nargs="+", default=["tiny", "clip-l-share"], choices=["tiny", "clip-l-share"]
    )
    parser.add_argument("--num-requests", type=int, default=6)
    parser.add_argument("--shared-images", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    report = {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": os.getloadavg()[0],
        "num_requests": args.num_requests,
        "shared_images": args.shared_images,
        "output_len": args.output_len,
        "reps": args.reps,
        "llava_15_7b_flop_share": flop_share(LLAVA_15_7B),
        "configs": [],
    }
    with tempfile.TemporaryDirectory(prefix="multimodal_bench_") as tmp:
        for name in args.configs:
            folder = Path(tmp) / name
            if name == "tiny":
                make_tiny_llava(folder, seed=0)
            else:
                make_seeded_llava(folder, CLIP_L_SHARE, seed=0)
            report["configs"].append(bench_config(name, str(folder), args))
    report["load_average_1m_after"] = os.getloadavg()[0]
    report["seconds"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "multimodal_cpu.json").write_text(json.dumps(report, indent=2))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
