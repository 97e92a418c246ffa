"""Write one benchmark's section of docs/benchmarks.md without touching the others.

Each benchmark owns the text between ``<!-- BEGIN name -->`` and
``<!-- END name -->``; a missing section is appended.
"""

from __future__ import annotations

import datetime
import platform
import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def machine_line() -> str:
    """One line naming the machine, for every table's header."""
    try:
        import os

        cores = os.cpu_count()
    except Exception:  # pragma: no cover
        cores = "?"
    return f"{platform.machine()}, {cores} cores, Python {sys.version.split()[0]}, {platform.platform()}"


def now_stamp() -> str:
    """The time now as the sections write it (UTC, minutes)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def write_section(name: str, title: str, command: str, body_markdown: str, doc: Path = DOC,
                  stamp: str | None = None) -> None:
    """Replace (or append) section ``name`` with a header, the command, date, machine and body.
    ``stamp``: the date line (default: now), e.g. the measuring run's when a table is only re-rendered."""
    stamp = stamp or now_stamp()
    block = (
        f"<!-- BEGIN {name} -->\n## {title}\n\n"
        f"Command: `{command}`  \nDate: {stamp}  \nMachine: {machine_line()}\n\n"
        f"{body_markdown.rstrip()}\n<!-- END {name} -->\n"
    )
    text = doc.read_text() if doc.exists() else "# Benchmarks\n\nEach section is written by the script named in its command; rerun it to refresh.\n\n"
    pattern = re.compile(rf"<!-- BEGIN {re.escape(name)} -->.*?<!-- END {re.escape(name)} -->\n?", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _m: block, text)
    else:
        text = text.rstrip() + "\n\n" + block
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
