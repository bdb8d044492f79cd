"""``python -m mini_vllm.oracle.upstream_suite [--phase NN [--impl labs|ref]]`` (runner.py)."""

import sys

from mini_vllm.oracle.upstream_suite.runner import main

sys.exit(main())
