"""Every float flag of ``fleetserve router`` refuses ``nan`` and ``inf`` in one line naming the flag
(they passed the ``>= 0`` checks before), and a finite value still parses."""

import pytest

from fleetserve.router.config import build_parser, parse_args

FLOAT_ACTIONS = [a for a in build_parser()._actions if getattr(a.type, "__name__", "") == "finite_float"]
FLOAT_FLAGS = [a.option_strings[0] for a in FLOAT_ACTIONS]
NAMES = {a.option_strings[0]: "/".join(a.option_strings) for a in FLOAT_ACTIONS}  # as argparse names aliases


def test_the_float_flags_are_all_covered():
    assert {"--kv-load-weight", "--kv-prefill-weight", "--kv-loads-interval-secs", "--cache-threshold",
            "--request-timeout-secs", "--retry-jitter-factor"} <= set(FLOAT_FLAGS)


@pytest.mark.parametrize("flag", FLOAT_FLAGS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_values_are_refused(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--worker-urls", "http://127.0.0.1:9", f"{flag}={value}"])  # = : "-inf" is not a flag
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == f"fleetserve router: error: argument {NAMES[flag]}: must be a finite number, got {value!r}"


def test_a_bad_float_names_the_flag_and_a_finite_one_parses(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--worker-urls", "http://127.0.0.1:9", "--cache-threshold", "abc"])
    assert capsys.readouterr().err.strip() == "fleetserve router: error: argument --cache-threshold: invalid float value: 'abc'"
    assert parse_args(["--worker-urls", "http://127.0.0.1:9", "--kv-load-weight", "0.25"]).kv_load_weight == 0.25
