"""The argument parser every ``fleetserve`` subcommand uses.

Standard library only; ``serve`` here and ``bench``, ``sim-worker`` and
``launch`` on the floors above use it. The router keeps its own copy of these
few lines (``fleetserve.router.config``): it imports nothing of fleetserve
outside ``fleetserve.router``, so it can ship alone. A bad flag ends the
process with one line naming the flag (``PROG: error: argument --tp-size:
invalid int value: 'x'``) and exit code 2, as argparse, but without the usage
block: in a launch log of several processes it buries the line that matters.
"""

from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line on stderr (exit code 2); ``--help`` is unchanged."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")
