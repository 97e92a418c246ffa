import subprocess
import sys

from fleetserve.cli import SUBCOMMANDS, main


def test_unknown_command_is_an_error(capsys):
    assert main(["no-such-command"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_no_command_is_a_usage_error(capsys):
    assert main([]) == 2  # as argparse for a missing required subcommand
    err = capsys.readouterr().err
    assert err.startswith("fleetserve: a command is required\n") and "usage: fleetserve <command>" in err


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


def test_import_fleetserve_does_not_import_torch():
    code = "import sys, fleetserve, fleetserve.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
