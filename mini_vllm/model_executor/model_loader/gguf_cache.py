"""A local cache of what loading a GGUF computes: the config, the dequantized
weights and the converted tokenizer, so that the second load skips the work.

mini_vllm's own (upstream reads GGUF through transformers and has no such
cache; see UPSTREAM_PIN.md). Reading SmolLM2's GGUF parses the file,
dequantizes 272 tensors to float32 and converts the embedded tokenizer to a
fast tokenizer: seconds of work whose result never changes for a given file.

One entry per GGUF path, in ``cache_dir() / "gguf" / <hash of the resolved
path>``: ``config.json``, ``model.safetensors`` (the HF-named float32
tensors ``gguf_weights_iterator`` yields), ``tokenizer/`` (when the GGUF has
one) and, written last, ``manifest.json``: the GGUF's path, size and
modification time, and the size and CRC-32 of every file. An entry
is used only if the manifest names the GGUF as it is now (else: stale) and
every file has its recorded size and digest (else: corrupt); otherwise it is
rebuilt from the GGUF. Entries are built in a temporary folder and renamed
into place, so an interrupted build leaves no entry.

Location: ``$MINI_VLLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/mini_vllm``, else
``~/.cache/mini_vllm``. ``MINI_VLLM_CACHE_DIR=off`` turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer, PretrainedConfig

from mini_vllm.model_executor.model_loader import default_loader, gguf_loader

VERSION = 1  # bump when what an entry holds changes


def cache_dir() -> Path | None:
    """The cache's root folder, or None when turned off."""
    explicit = os.environ.get("MINI_VLLM_CACHE_DIR")
    if explicit == "off":
        return None
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mini_vllm"


def source_of(path: Path) -> dict:
    """What identifies the GGUF as it is now."""
    stat = path.stat()
    return {
        "path": str(path.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "version": VERSION,
    }


def entry_dir(root: Path, path: Path) -> Path:
    return root / "gguf" / hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24]


def file_digest(path: Path) -> str:
    """CRC-32 of the file: catches accidental damage (a flipped bit, a torn write), not
    tampering, at twice the speed of a cryptographic hash (it is read on every load)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def entry_problem(entry: Path, source: dict) -> str | None:
    """Why the entry cannot be used ("missing", "stale", "corrupt: ..."), or None if it can."""
    try:
        manifest = json.loads((entry / "manifest.json").read_text())
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError):
        return "corrupt: unreadable manifest"
    if manifest.get("source") != source:
        return "stale"
    files = manifest.get("files")
    if not isinstance(files, dict) or "model.safetensors" not in files:
        return "corrupt: manifest lists no weights"
    for name, (size, digest) in files.items():
        file = entry / name
        if not file.is_file() or file.stat().st_size != size:
            return f"corrupt: {name} is missing or has the wrong size"
        if file_digest(file) != digest:
            return f"corrupt: {name} does not match its digest"
    return None


def build_entry(entry: Path, path: Path, source: dict) -> None:
    """Load the GGUF the slow way and write an entry for it at ``entry`` (replaced)."""
    reader = gguf_loader.open_gguf(path)
    hf_config = gguf_loader.gguf_to_hf_config(reader, path)
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".build-"))
    try:
        hf_config.save_pretrained(tmp)
        weights = dict(gguf_loader.gguf_weights_iterator(reader, hf_config, path))
        save_file(weights, tmp / "model.safetensors")
        del weights
        if gguf_loader.has_tokenizer(reader):
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            tokenizer.save_pretrained(tmp / "tokenizer")
        files = {
            str(f.relative_to(tmp)): [f.stat().st_size, file_digest(f)]
            for f in sorted(tmp.rglob("*"))
            if f.is_file()
        }
        manifest = {"source": source, "files": files}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        shutil.rmtree(entry, ignore_errors=True)
        tmp.rename(entry)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def cached_gguf(
    path: Path,
) -> tuple[PretrainedConfig, Iterator[tuple[str, torch.Tensor]], Path | None] | None:
    """(hf_config, weights, tokenizer folder or None) of the GGUF at ``path`` from
    its cache entry, built first if missing, stale or corrupt; None with the
    cache turned off or its folder not writable."""
    root = cache_dir()
    if root is None:
        return None
    source, entry = source_of(path), entry_dir(root, path)
    if entry_problem(entry, source) is not None:
        try:
            build_entry(entry, path, source)
        except OSError:
            return None  # a read-only or full cache folder: load from the GGUF
    hf_config = default_loader.load_hf_config(entry)
    weights = default_loader.safetensors_weights_iterator([entry / "model.safetensors"])
    tokenizer = entry / "tokenizer"
    return hf_config, weights, tokenizer if tokenizer.is_dir() else None
