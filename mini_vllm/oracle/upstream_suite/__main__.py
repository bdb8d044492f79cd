"""``python -m mini_vllm.oracle.upstream_suite [--phase 02|03 [--impl labs|ref]]`` (runner.py)."""

import sys

from mini_vllm.oracle.upstream_suite.runner import main

sys.exit(main())
