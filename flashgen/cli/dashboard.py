"""`flashgen dashboard`: optuna-dashboard on the tuners' studies (trials, failures, importances)."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from flashgen import fleet
from flashgen.studies import describe, resolve
from .common import STORAGE_HELP, CliError, open_storage


def add_parser(sub: Any) -> None:
    d = sub.add_parser("dashboard", help="open optuna-dashboard on the studies: trials, failures, importances "
                                         "(pip install -e '.[fleet]')")
    d.add_argument("--storage", default=None, help=STORAGE_HELP)
    d.add_argument("--host", default="127.0.0.1",
                   help="address to serve on (default 127.0.0.1; the dashboard has no authentication: anyone who "
                        "reaches another address can change the studies)")
    d.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    d.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        import optuna_dashboard  # optional dependency (the fleet extra)
    except ImportError:
        raise CliError("the dashboard needs optuna-dashboard: pip install -e '.[fleet]'") from None

    storage = open_storage(args.storage)
    exposed = fleet.dashboard_exposure(args.host)
    if exposed:
        print(exposed, file=sys.stderr, flush=True)
    print(f"optuna-dashboard for {describe(resolve(args.storage))} on http://{args.host}:{args.port}/ "
          "(Ctrl-C stops it)", flush=True)
    optuna_dashboard.run_server(storage, host=args.host, port=args.port)
    return 0

