"""`opd serve`: register the deployments with a Prefect server and run them in this process.

Deployments: `opd-pipeline/full` (the whole pipeline; parameters profile, overrides, rounds,
stages, chain, run_name, root, workers, dask_address). Re-running single stages on cached shards goes through the
same deployment's `stages` parameter, e.g. `-p 'stages=["score-r1"]'`.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

from flows.pipeline import opd_pipeline
from storage import OpdError

# Never phone home: the project runs offline and only ever talks to a loopback server.
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def check_server() -> str:
    """The API URL, after checking the server answers; a clear error says how to start one."""
    url = os.environ.get("PREFECT_API_URL")
    how = (
        "start a local server with `prefect server start --host 127.0.0.1 --port 4200` "
        "and `export PREFECT_API_URL=http://127.0.0.1:4200/api`"
    )
    if not url:
        raise OpdError(f"PREFECT_API_URL is not set, so there is no server to register with: {how}")
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as r:
            json.loads(r.read() or b"true")
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise OpdError(f"no Prefect server answers at {url} ({e}): {how}") from None
    return url


def serve(root: str | None) -> None:
    check_server()
    params = {"root": root} if root else {}
    opd_pipeline.serve(
        name="full",
        parameters=params,
        pause_on_shutdown=False,
        print_starting_message=True,
    )
