"""``python -m mini_vllm``: the command-line generator (see entrypoints/cli.py)."""

import sys

from mini_vllm.entrypoints.cli import main

sys.exit(main())
