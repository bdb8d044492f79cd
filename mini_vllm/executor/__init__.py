"""Executors (upstream ``vllm/v1/executor/``): ``MultiprocExecutor`` runs a
tensor-parallel model in one worker process a rank. With one process the
engine core drives its model runner itself (upstream's ``UniProcExecutor``)."""
