"""Lab 03 (19.3) — the whole engine served: your code of every phase at once.

Graded: nothing new to write. Every lab region of every phase in
``labs/phase_NN/`` goes into the reference's modules at once
(``mini_vllm/grading/assemble.py``), and ``mini-vllm serve`` runs that engine
on SmolLM2 in a subprocess beside the reference's server. The official
``openai`` client sends both the same requests (``mini_vllm/grading/capstone.py``),
both servers with n-gram speculative decoding on: greedy completions and
chats, whole and streamed, token ids included; four prompts alone, then as
concurrent streams; a chat constrained to a choice; the speculative-decoding
counters; a client that disconnects mid-stream, after which ``/metrics``
must show every KV block free. Everything must come back equal. When it
does not, the grader swaps the reference's code back in phase by phase and
names the first phase whose code makes the run differ.
"""

from __future__ import annotations

import pytest

from mini_vllm.grading import capstone
from mini_vllm.grading.impl import impl_name, labs_dir


@pytest.mark.points(20)
@pytest.mark.timeout(1800)
def test_your_engine_answers_as_the_reference():
    with capstone.serve() as url:
        reference = capstone.transcript(url)
    # IMPL=ref serves the reference twice: none of your phases.
    phases = None if impl_name() == "labs" else []
    why = capstone.grade(labs_dir(), reference, phases)
    if why is not None:
        why += "\n" + capstone.bisect(labs_dir(), reference, why)
    assert why is None, why
