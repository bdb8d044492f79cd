"""Upstream's own unit tests at the pin, run against the pinned vllm and against mini_vllm.

``fetch`` gets the tests from the vllm 0.22.1 sdist into build/upstream-tests/;
``plugin`` is the pytest plugin that runs them on a CPU and redirects their
imports to mini_vllm; ``scope.toml`` says which valid tests mini_vllm must pass
and why the others are out; ``python -m mini_vllm.oracle.upstream_suite``
(``make upstream-tests``) runs both and prints the counts per file.
"""
