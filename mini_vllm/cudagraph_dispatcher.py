"""Which CUDA graph, if any, runs a step, and the batch size it is padded to.

Mirrors upstream ``vllm/v1/cudagraph_dispatcher.py`` (``CudagraphDispatcher``
:15; ``_compute_bs_to_padded_graph_size`` :76, ``_create_padded_batch_descriptor``
:136, ``initialize_cudagraph_keys`` :170, ``dispatch`` :239,
``get_capture_descs`` :330) at v0.22.1.

A graph replays one fixed shape, so the runner captures a few batch sizes
(``compilation_config.cudagraph_capture_sizes``) and pads each step up to
the next captured size. The dispatcher holds the keys (``BatchDescriptor``)
of every graph there is, one set for FULL graphs and one for PIECEWISE
graphs; ``dispatch`` turns a step's token count into the key of the graph
to replay and its runtime mode, or NONE (run eagerly, unpadded) when no
graph fits: above the largest captured size, or when no allowed mode has a
key for the step.

Left out: LoRA (upstream also keys graphs by whether adapters are active and
how many), the check that ``compile_sizes`` survive padding (mini_vllm
compiles nothing) and the assertion that PIECEWISE modes come with
piecewise compilation (the keys are the same without it; mini_vllm's runner
captures FULL graphs only).
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import replace

from mini_vllm.config import CUDAGraphMode, VllmConfig
from mini_vllm.forward_context import BatchDescriptor


class CudagraphDispatcher:
    def __init__(self, vllm_config: VllmConfig):
        self.vllm_config = vllm_config
        self.compilation_config = vllm_config.compilation_config
        # A decode request's query length: 1, or 1 + its drafts when speculating.
        spec = vllm_config.speculative_config
        self.uniform_decode_query_len = 1 if spec is None else 1 + spec.num_speculative_tokens
        # The keys of the graphs there are, by runtime mode.
        self.cudagraph_keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {
            CUDAGraphMode.PIECEWISE: set(),
            CUDAGraphMode.FULL: set(),
        }
        self.keys_initialized = False
        # NONE until the runner calls initialize_cudagraph_keys.
        self.cudagraph_mode = CUDAGraphMode.NONE

    # BEGIN LAB 18.2: the padded size of every batch size
    def _compute_bs_to_padded_graph_size(self) -> None:
        """``_bs_to_padded_graph_size[n]``: the smallest captured size >= n,
        for every n up to the largest captured size (0 stays 0)."""
        # HINT: upstream: vllm/v1/cudagraph_dispatcher.py:76. capture_sizes are sorted ascending.
        max_size = self.compilation_config.max_cudagraph_capture_size
        capture_sizes = self.compilation_config.cudagraph_capture_sizes
        assert max_size is not None and capture_sizes is not None, "capture sizes not set"
        self._bs_to_padded_graph_size: list[int] = [0] * (max_size + 1)
        previous = 0
        for size in capture_sizes:
            for n in range(previous + 1, size + 1):
                self._bs_to_padded_graph_size[n] = size
            previous = size

    # END LAB 18.2

    # BEGIN LAB 18.2: a batch's padded key
    def _create_padded_batch_descriptor(
        self, num_tokens: int, uniform_decode: bool
    ) -> BatchDescriptor:
        """The key of the graph a batch of ``num_tokens`` pads to. A uniform
        decode batch keeps ``uniform`` only where the mode has FULL graphs; its
        request count is the padded tokens over the decode query length, any
        other batch's is the padded tokens (one token a request at most);
        both are capped at max_num_seqs."""
        # HINT: upstream: cudagraph_dispatcher.py:136. The FULL check is has_mode, not ==.
        max_num_seqs = self.vllm_config.scheduler_config.max_num_seqs
        num_tokens_padded = self._bs_to_padded_graph_size[num_tokens]
        if uniform_decode and self.cudagraph_mode.has_mode(CUDAGraphMode.FULL):
            assert num_tokens_padded % self.uniform_decode_query_len == 0
            num_reqs = min(num_tokens_padded // self.uniform_decode_query_len, max_num_seqs)
        else:
            uniform_decode = False
            num_reqs = min(num_tokens_padded, max_num_seqs)
        return BatchDescriptor(
            num_tokens=num_tokens_padded, num_reqs=num_reqs, uniform=uniform_decode
        )

    # END LAB 18.2

    def add_cudagraph_key(self, runtime_mode: CUDAGraphMode, batch_descriptor: BatchDescriptor):
        assert runtime_mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL), runtime_mode
        self.cudagraph_keys[runtime_mode].add(batch_descriptor)

    # BEGIN LAB 18.2: the keys of the graphs to capture
    def initialize_cudagraph_keys(
        self, cudagraph_mode: CUDAGraphMode, uniform_decode_query_len: int = 1
    ) -> None:
        """Build every key of ``cudagraph_mode`` (the mode the runner settled
        on). The mixed mode gets a key per capture size (a PIECEWISE key with
        any request count and not uniform); a separate FULL decode mode gets a
        uniform key per capture size from the decode query length up to
        ``uniform_decode_query_len * max_num_seqs`` tokens."""
        # HINT: upstream: cudagraph_dispatcher.py:170. mixed_mode(), decode_mode() and
        # HINT: separate_routine() are CUDAGraphMode's; a PIECEWISE key drops num_reqs and uniform.
        self.cudagraph_mode = cudagraph_mode
        if cudagraph_mode == CUDAGraphMode.NONE:
            self.keys_initialized = True
            return
        self._compute_bs_to_padded_graph_size()
        capture_sizes = self.compilation_config.cudagraph_capture_sizes

        mixed_mode = cudagraph_mode.mixed_mode()
        if mixed_mode != CUDAGraphMode.NONE:
            for size in capture_sizes:
                key = self._create_padded_batch_descriptor(size, uniform_decode=False)
                if mixed_mode == CUDAGraphMode.PIECEWISE:
                    key = replace(key, num_reqs=None, uniform=False)
                self.add_cudagraph_key(mixed_mode, key)

        if cudagraph_mode.decode_mode() == CUDAGraphMode.FULL and cudagraph_mode.separate_routine():
            max_num_tokens = (
                uniform_decode_query_len * self.vllm_config.scheduler_config.max_num_seqs
            )
            for size in capture_sizes:
                if uniform_decode_query_len <= size <= max_num_tokens:
                    key = self._create_padded_batch_descriptor(size, uniform_decode=True)
                    self.add_cudagraph_key(CUDAGraphMode.FULL, key)
        self.keys_initialized = True

    # END LAB 18.2

    # BEGIN LAB 18.2: a step's mode and key
    def dispatch(
        self,
        num_tokens: int,
        uniform_decode: bool = False,
        valid_modes: AbstractSet[CUDAGraphMode] | None = None,
        invalid_modes: AbstractSet[CUDAGraphMode] | None = None,
    ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """The runtime mode and graph key of a step of ``num_tokens`` tokens
        (``uniform_decode``: every request decodes ``uniform_decode_query_len``
        tokens). Modes are tried FULL first, then PIECEWISE (with the key
        relaxed to any request count), among ``valid_modes`` (None: all three)
        less ``invalid_modes``; NONE, with an unpadded key, when none fits."""
        # HINT: upstream: cudagraph_dispatcher.py:239. NONE's key is BatchDescriptor(num_tokens).
        allowed_modes = valid_modes or CUDAGraphMode.valid_runtime_modes()
        if invalid_modes:
            allowed_modes = allowed_modes - invalid_modes
        assert allowed_modes, f"no allowed mode: valid {valid_modes}, invalid {invalid_modes}"
        max_size = self.compilation_config.max_cudagraph_capture_size
        if (
            not self.keys_initialized
            or self.cudagraph_mode == CUDAGraphMode.NONE
            or max_size is None
            or num_tokens > max_size
            or allowed_modes <= {CUDAGraphMode.NONE}
        ):
            return CUDAGraphMode.NONE, BatchDescriptor(num_tokens)

        # Only a mode with separate decode graphs tells decodes apart.
        uniform = uniform_decode and self.cudagraph_mode.separate_routine()
        key = self._create_padded_batch_descriptor(num_tokens, uniform)
        if CUDAGraphMode.FULL in allowed_modes and key in self.cudagraph_keys[CUDAGraphMode.FULL]:
            return CUDAGraphMode.FULL, key
        if CUDAGraphMode.PIECEWISE in allowed_modes:
            relaxed = replace(key, num_reqs=None, uniform=False)
            if relaxed in self.cudagraph_keys[CUDAGraphMode.PIECEWISE]:
                return CUDAGraphMode.PIECEWISE, relaxed
        assert CUDAGraphMode.NONE in allowed_modes, (
            f"no graph fits and NONE is not in {allowed_modes}"
        )
        return CUDAGraphMode.NONE, BatchDescriptor(num_tokens)

    # END LAB 18.2

    def get_capture_descs(self) -> list[tuple[CUDAGraphMode, list[BatchDescriptor]]]:
        """The graphs to capture: PIECEWISE keys, then FULL keys, each
        largest first (the largest graph's memory pool serves the rest)."""
        if not self.keys_initialized or self.cudagraph_mode == CUDAGraphMode.NONE:
            return []
        result = []
        for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            keys = sorted(self.cudagraph_keys[mode], key=lambda k: k.num_tokens, reverse=True)
            if keys:
                result.append((mode, keys))
        return result
