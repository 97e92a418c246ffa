"""The ``fleetserve`` command line: one subcommand per part of the stack.

Each subcommand lives in its own module and is imported only when chosen, so
``fleetserve router`` never imports torch.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, help). Each module exposes ``main(argv: list[str]) -> int | None``.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("fleetserve.entrypoints.serve", "run one engine instance (OpenAI-compatible HTTP API)"),
    "router": ("fleetserve.router.cli", "run the cache-aware load balancer"),
    "launch": ("fleetserve.launch", "start a router plus N engine instances"),
    "bench": ("fleetserve.bench.cli", "drive a workload against an OpenAI-compatible URL"),
    "sim-worker": ("fleetserve.bench.sim_worker", "run a simulated engine worker (radix cache + timing model)"),
}


def _usage() -> str:
    lines = ["usage: fleetserve <command> [options]", "", "commands:"]
    for name, (_, help_text) in SUBCOMMANDS.items():
        lines.append(f"  {name:<12} {help_text}")
    lines.append("")
    lines.append("Run 'fleetserve <command> --help' for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # a missing command is a usage error: argparse exits 2 for a missing required subcommand
        print(f"fleetserve: a command is required\n\n{_usage()}", file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from fleetserve import __version__

        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"fleetserve: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(SUBCOMMANDS[name][0])
        return int(module.main(rest) or 0)
    except KeyboardInterrupt:  # Ctrl-C before the command set its own handlers (while importing, say)
        print(f"fleetserve {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
