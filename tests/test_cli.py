from typer.testing import CliRunner

from lorapop.cli import app


def test_help_lists_commands():
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "lorapop" in result.output
