"""Check chat messages and turn them into the conversation a chat template renders.

Mirrors upstream ``vllm/entrypoints/chat_utils.py`` at v0.22.1
(``parse_chat_messages`` :1845, ``_parse_chat_message_content`` :1726,
``_parse_chat_message_content_parts`` :1550, ``_parse_chat_message_content_part``
:1610, ``_postprocess_messages`` :1803) for text messages in the "string"
content format, the one SmolLM2's template takes. Left out: multimodal parts
other than images (refused here), the "openai" content format and its
detection from the template, prompt embeddings, the ``task`` field and a
developer message's ``tools``.

Images (Phase 13), for a multimodal model only (the caller passes an
``images`` list to fill): an ``image_url`` part whose ``url`` is a data URL
(``data:image/png;base64,...``; nothing is ever fetched, so any other URL is
refused) is decoded into an RGB PIL image (transparency over white), as
upstream's ``ImageMediaIO.load_bytes`` (vllm/multimodal/media/image.py:70)
does, and appended to ``images``; the
message's text then starts with one placeholder (``<image>``) per image
the text does not already hold, each on its own line, as upstream's
``_get_full_multimodal_text_prompt`` (:1338) puts them. More placeholders
in a message's text than images in it is an error (upstream's words).

What upstream accepts, kept here:
- ``content`` None or missing is empty content (""), for every role: an
  assistant message that only calls tools has none;
- ``content`` a list of parts: plain strings and text parts (types text,
  input_text, output_text, refusal, thinking) joined with newlines; a text
  part whose text is None is skipped;
- any role string; an assistant's ``tool_calls`` (an empty list is dropped;
  each call's JSON ``arguments`` string becomes a dict, as templates expect)
  and ``reasoning``; a tool message's ``tool_call_id``; a string ``name``.

What upstream fails on with a traceback (a message that is not a dict, no
``role``, ``content`` of another type, a part without a ``type``) or refuses
(an unknown part type, a tool call that is not a function) is refused here
with a ValueError in one line naming the message, before the template runs.
Stricter than upstream: a ``role`` that is not a string (upstream's type says
str; its parser passes it on and the template then fails) and a text part's
text that is not a string.
"""

from __future__ import annotations

import base64
import binascii
import copy
import io
import json

from PIL import Image, UnidentifiedImageError

# Upstream's text part types and the key each keeps its text under
# (MM_PARSER_MAP, vllm/entrypoints/chat_utils.py:1413).
TEXT_PART_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# Upstream's other part types: multimodal inputs and tool references.
OTHER_PART_TYPES = (
    "input_image",
    "image_url",
    "image_embeds",
    "audio_embeds",
    "prompt_embeds",
    "image_pil",
    "audio_url",
    "input_audio",
    "video_url",
    "tool_reference",
)


def parse_chat_messages(
    messages: object,
    where: str = "messages",
    images: list | None = None,
    image_placeholder: str = "<image>",
) -> list[dict]:
    """One conversation, checked and normalised: a new list of new dicts (the
    caller's messages are not changed). ``where`` names the conversation in
    errors, e.g. ``messages[2]`` for the third of several. ``images``: for a
    multimodal model, a list that receives the conversation's images in order
    (None: image parts are refused); ``image_placeholder`` marks each in the text."""
    if not isinstance(messages, list):
        raise ValueError(f"{where} must be a list of message dicts, got {type(messages).__name__}.")
    return [
        _parse_message(message, f"{where}[{i}]", images, image_placeholder)
        for i, message in enumerate(messages)
    ]


def load_image_data_url(url: object, where: str) -> Image.Image:
    """A ``data:image/...;base64,...`` URL -> an RGB PIL image; ValueError otherwise."""
    if not isinstance(url, str) or not url.startswith("data:"):
        raise ValueError(
            f"{where}: only data URLs (data:image/...;base64,...) are supported; "
            "mini_vllm fetches nothing."
        )
    header, sep, data = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError(f"{where}: a data URL must be base64 (data:image/png;base64,...).")
    try:
        image = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
        image.load()
    except (binascii.Error, ValueError, UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{where}: the data URL is not an image ({e}).") from None
    if image.mode == "RGBA":  # transparent pixels over white (upstream's rgba_to_rgb)
        rgb = Image.new("RGB", image.size, (255, 255, 255))
        rgb.paste(image, mask=image.split()[3])
        return rgb
    return image.convert("RGB")


def _parse_message(
    message: object, where: str, images: list | None = None, image_placeholder: str = "<image>"
) -> dict:
    if not isinstance(message, dict):
        raise ValueError(
            f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}."
        )
    if "role" not in message:
        raise ValueError(f"{where} has no 'role'.")
    role = message["role"]
    if not isinstance(role, str):
        raise ValueError(f"{where}['role'] must be a string, got {type(role).__name__}.")
    parsed = {
        "role": role,
        "content": _parse_content(message.get("content"), where, images, image_placeholder),
    }
    if role == "assistant":
        if message.get("tool_calls") is not None:
            _parse_tool_calls(parsed, message["tool_calls"], where)
        if message.get("reasoning") is not None:
            parsed["reasoning"] = parsed["reasoning_content"] = message["reasoning"]
    elif role == "tool" and "tool_call_id" in message:
        parsed["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        parsed["name"] = message["name"]
    return parsed


def _parse_content(
    content: object, where: str, images: list | None = None, image_placeholder: str = "<image>"
) -> str:
    """None -> "", a string as it is, a list of parts -> their texts joined by
    newlines, after one placeholder line per image the texts do not mark."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(
            f"{where}['content'] must be a string, a list of content parts or None, "
            f"got {type(content).__name__}."
        )
    texts = []
    num_images = 0
    for j, part in enumerate(content):
        at = f"{where}['content'][{j}]"
        if images is not None and isinstance(part, dict) and part.get("type") == "image_url":
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else image_url
            images.append(load_image_data_url(url, f"{at}['image_url']"))
            num_images += 1
            continue
        text = _parse_part(part, at)
        if text is not None:
            texts.append(text)
    text_prompt = "\n".join(texts)
    if not num_images:
        return text_prompt
    missing = num_images - text_prompt.count(image_placeholder)
    if missing < 0:
        raise ValueError(
            f"{where}: Found more '{image_placeholder}' placeholders in input prompt than "
            "actual multimodal data items."
        )
    return "\n".join([image_placeholder] * missing + ([text_prompt] if text_prompt else []))


def _parse_part(part: object, where: str) -> str | None:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise ValueError(f"{where} must be a string or a dict, got {type(part).__name__}.")
    part_type = part.get("type")
    if part_type is None:
        raise ValueError(f"{where} has no 'type'.")
    if part_type in TEXT_PART_KEYS:
        text = part.get(TEXT_PART_KEYS[part_type])
        if text is not None and not isinstance(text, str):
            raise ValueError(
                f"{where}[{TEXT_PART_KEYS[part_type]!r}] must be a string, "
                f"got {type(text).__name__}."
            )
        return text  # None: skipped, as upstream
    if part_type in OTHER_PART_TYPES:
        raise ValueError(
            f"{where}: content parts of type {part_type!r} are not supported "
            "(mini_vllm's chat takes text only)."
        )
    raise ValueError(
        f"{where}: unsupported content part type {part_type!r}; text parts have type "
        f"{', '.join(TEXT_PART_KEYS)}."
    )


def _parse_tool_calls(parsed: dict, tool_calls: object, where: str) -> None:
    """An assistant's tool calls as templates want them (upstream's
    ``_postprocess_messages``): none left if the list is empty, each a
    function call whose ``arguments`` are a dict ({} when missing or empty)."""
    if not isinstance(tool_calls, (list, tuple)):
        raise ValueError(f"{where}['tool_calls'] must be a list, got {type(tool_calls).__name__}.")
    if not tool_calls:
        return
    tool_calls = copy.deepcopy(list(tool_calls))
    for k, call in enumerate(tool_calls):
        at = f"{where}['tool_calls'][{k}]"
        if not isinstance(call, dict):
            raise ValueError(f"{at} must be a dict, got {type(call).__name__}.")
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, dict):
            raise ValueError(f"{at} must be a call of type 'function' with a 'function' dict.")
        arguments = function.get("arguments")
        if not arguments:
            function["arguments"] = {}
        elif not isinstance(arguments, (dict, list)):
            try:
                function["arguments"] = json.loads(arguments)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{at}['function']['arguments'] is not JSON: {e}") from None
    parsed["tool_calls"] = tool_calls
