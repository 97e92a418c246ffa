"""``python -m fleetserve.router.args_check FLAG...``: check a router command line, start nothing.

``fleetserve launch`` runs it on the router command line it is about to use (its own flags plus
``--router-args``) before it starts any instance, so that a bad router flag costs no model load.
The checks are the router's own (:func:`.config.parse_args`: argparse, the refused sglang-router
flags, :meth:`.config.RouterConfig.validate`), nothing is bound and no worker is contacted.

Exit 0 with one JSON object on stdout::

    {"policy": "cache_aware", "host": "127.0.0.1", "port": 30000, "prometheus_host": "127.0.0.1",
     "prometheus_port": null, "warnings": []}

(what the launcher still needs to know: the policy the router will run, the address it will listen
on (the last ``--host`` / ``--port`` given, as the router's parser reads them), its extra metrics
listener, and the lines the router will log for flags its policy does not read, :mod:`.policy_flags`);
exit 2 with the parser's one line on stderr (``fleetserve router: error: ...``).
"""

from __future__ import annotations

import json
import sys

from .config import parse_args
from .policy_flags import policy_flag_warnings


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_args(argv)  # SystemExit(2) on a bad flag
    print(json.dumps({"policy": cfg.policy, "host": cfg.host, "port": cfg.port,
                      "prometheus_host": cfg.prometheus_host, "prometheus_port": cfg.prometheus_port,
                      "warnings": policy_flag_warnings(argv, cfg)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
