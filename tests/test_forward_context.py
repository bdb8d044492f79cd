"""The forward context is per thread: an engine stepping in AsyncLLM's thread and
an offline LLM in the caller's thread never read each other's metadata."""

from __future__ import annotations

import threading

import pytest

from mini_vllm.forward_context import get_forward_context, set_forward_context


def test_outside_a_forward_there_is_no_context():
    with pytest.raises(RuntimeError, match="No forward context"):
        get_forward_context()


def test_contexts_nest_and_restore():
    a, b = object(), object()
    with set_forward_context(a):
        with set_forward_context(b):
            assert get_forward_context().attn_metadata is b
        assert get_forward_context().attn_metadata is a


def test_two_threads_each_see_their_own_context():
    # Thread 1 enters its forward, then thread 2 enters and leaves one while
    # thread 1 is still inside: thread 1 must still read its own metadata.
    inside, left = threading.Event(), threading.Event()
    seen = {}

    def first():
        with set_forward_context("first"):
            inside.set()
            left.wait(10)
            seen["first"] = get_forward_context().attn_metadata

    def second():
        inside.wait(10)
        with set_forward_context("second"):
            seen["second"] = get_forward_context().attn_metadata
        try:
            get_forward_context()
        except RuntimeError:
            seen["second after"] = None
        left.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"first": "first", "second": "second", "second after": None}
