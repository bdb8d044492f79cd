"""Runs the docs' examples in processes forked from one that has imported torch.

tests/upstream/test_phase_docs.py starts this file with ``python -c`` (so
``sys.path[0]`` and ``sys.argv`` are what ``python -c <example>`` gives) and
PYTHONHASHSEED=0. It imports torch once (about 1.4 s of the 1.7 s a bare
``python -c`` example costs), then, for each line read on stdin
(JSON: ``{"code", "out", "err"}``):

- forks; the child starts a session of its own (so a timeout kills what it
  started too), reads stdin from /dev/null, writes stdout and stderr to the
  two files, and runs the code as ``python -c`` would: in a new ``__main__``
  module, ending the process as an interpreter does (an exception prints its
  traceback and exits 1; non-daemon threads are joined; atexit runs);
- the server prints the child's pid, then its exit code, one line each.

Nothing else is imported before the fork, so mini_vllm's modules start
fresh in every example. Python's ``random`` reseeds itself in a forked child.
"""

import json
import os
import sys
import types

import torch  # noqa: F401  (the import every example would pay)

while True:
    line = sys.stdin.readline()
    if not line:
        sys.exit(0)
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        break
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)

# The child: the example's process from here on.
os.setsid()
for fd, path, flags in (
    (0, os.devnull, os.O_RDONLY),
    (1, job["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    (2, job["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
):
    opened = os.open(path, flags)
    os.dup2(opened, fd)
    os.close(opened)
main = types.ModuleType("__main__")
main.__builtins__ = __builtins__
sys.modules["__main__"] = main
exec(compile(job["code"], "<string>", "exec"), main.__dict__)
