"""Graded suites: the grading plugin's hooks and fixtures (see mini_vllm/grading/plugin.py).

Run them through ``make check-phase-NN`` / ``make check-lab-NN.M``, which
print the score table; ``IMPL=ref`` grades the reference instead of labs/.
"""

import os

# Without CUDA, Triton runs in its interpreter; it must be set before triton
# is first imported.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
except ImportError:
    pass

from mini_vllm.grading.plugin import *  # noqa: E402,F401,F403
