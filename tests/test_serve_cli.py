"""``mini-vllm serve``: its arguments and its one-line errors (the server itself: test_serve.py)."""

from __future__ import annotations

import pytest

from mini_vllm.entrypoints import cli


def test_serve_help_lists_the_server_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "mini-vllm serve" in out and "--port" in out and "--served-model-name" in out


def test_serve_with_a_missing_model_is_one_error_line(capsys, tmp_path):
    code = cli.main(["serve", str(tmp_path / "no-such-model"), "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("mini-vllm serve: error:") and "Traceback" not in err


def test_the_offline_cli_still_takes_a_prompt(capsys):
    # "serve" is only a subcommand in first position; otherwise the offline parser runs.
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    assert "--prompt" in capsys.readouterr().out
