"""`bmeg consume` and `bmeg serve` are registered, and a bad model is a clear error, not a traceback."""

from __future__ import annotations

from click.testing import CliRunner

from bmeg.cli import main


def test_both_commands_are_listed():
    result = CliRunner().invoke(main, ["--help"])
    assert "serve" in result.output and "consume" in result.output


def test_consume_with_a_missing_model_says_so(tmp_path):
    result = CliRunner().invoke(main, ["consume", "--model", str(tmp_path / "nowhere"), "--bootstrap", "127.0.0.1:1"])
    assert result.exit_code == 1
    assert result.output.startswith("Error: ") and "nowhere" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_serve_refuses_to_start_without_a_key_and_says_how(tmp_path, monkeypatch):
    monkeypatch.delenv("BMEG_API_KEY", raising=False)
    result = CliRunner().invoke(main, ["serve", "--model", str(tmp_path)])
    assert result.exit_code == 1 and "no API key: set BMEG_API_KEY" in result.output and "--no-auth" in result.output
    monkeypatch.setenv("BMEG_API_KEY", "")
    result = CliRunner().invoke(main, ["serve", "--model", str(tmp_path), "--no-auth"])
    assert result.exit_code == 1 and "BMEG_API_KEY is empty" in result.output
