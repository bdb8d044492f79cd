"""The course's grading machinery (project tooling, not part of the mirror).

- ``regions``: lab regions in the reference source; writes the ``labs/``
  starters, splices a student's regions with the reference's;
- ``impl``: loads the code a graded suite runs (the student's, or the
  reference's with ``IMPL=ref``);
- ``plugin``: the pytest plugin behind ``make check-phase-NN``: points,
  per-test timeouts, the score table and ``results.json``;
- ``run``: runs a graded suite in a child pytest that ``check`` watches, so
  that no code under grade can outlast its time limit or fake a score;
- ``checks``: scheduler checks the graded suites share (snapshots, lockstep
  against the reference);
- ``aging_checks``: Lab 09.2's promises of an aging rule, checked at every step;
- ``diff_upstream``: a mini_vllm (or student) symbol beside upstream's at the pin;
- ``assemble``: the student's code of every phase inside the reference's modules
  (``MINI_VLLM_STUDENT_PHASES``), for Phase 19's whole engine;
- ``capstone``: that engine served beside the reference's, the same ``openai``
  requests to both, and the first phase whose code makes them differ.

Run ``python -m mini_vllm.grading --help``.
"""
