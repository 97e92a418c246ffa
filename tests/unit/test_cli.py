import re
import subprocess
import sys

import pytest

from fleetserve import cli
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


# (subcommand, a flag that takes an int) for every subcommand
BAD_INT_FLAGS = {"serve": "--max-running-requests", "router": "--port", "launch": "--workers",
                 "bench": "--num-prompts", "sim-worker": "--port"}


def test_every_command_has_a_bad_flag_case():
    assert set(BAD_INT_FLAGS) == set(SUBCOMMANDS)


@pytest.mark.parametrize("name", sorted(BAD_INT_FLAGS))
def test_a_bad_flag_value_is_one_line_naming_the_flag(name, capsys):
    flag = BAD_INT_FLAGS[name]
    with pytest.raises(SystemExit) as exc:
        main([name, flag, "many"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    # one line, no usage block; argparse may list the flag's aliases after it ("--tp-size/--tp")
    assert err.count("\n") == 1 and "usage:" not in err, err
    assert re.fullmatch(rf"fleetserve {name}: error: argument {flag}(/\S+)?: invalid int value: 'many'\n", err), err


@pytest.mark.parametrize("name", ["serve", "router", "bench", "sim-worker"])
def test_an_unknown_flag_is_one_line(name, capsys):
    with pytest.raises(SystemExit) as exc:
        main([name, "--no-such-flag"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"fleetserve {name}: error: unrecognized arguments: --no-such-flag\n"


def test_help_still_shows_the_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("usage: fleetserve serve")


def test_ctrl_c_while_a_command_is_imported_is_one_line(monkeypatch, capsys):
    """A Ctrl-C that lands before a command set its own handlers (user trial: 0.03 s after
    ``fleetserve launch`` started, during its imports) gives one line and exit 130, no traceback."""
    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    assert cli.main(["launch", "--workers", "1"]) == 130
    out, err = capsys.readouterr()
    assert (out, err) == ("", "fleetserve launch: interrupted\n")
