"""What the command line's logging shows: the stages' lines and any warning, not the INFO
notices of the libraries under them, unless `--verbose`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import logging
from cli.common import setup_logging
setup_logging()
logging.getLogger("httpx").info("HTTP Request: GET http://127.0.0.1:8611/api/health")
logging.getLogger("prefect").info("Starting temporary server on http://127.0.0.1:8611")
logging.getLogger("prefect.flow_runs").info("Finished in state Completed()")
logging.getLogger("opd").info("[prompts] wrote prompts@abc")
logging.getLogger("prefect").warning("a warning from Prefect")
"""


def _stderr(**env: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=Path(__file__).resolve().parents[2],
        env={k: v for k, v in os.environ.items() if k != "OPD_VERBOSE"} | env,
        capture_output=True,
        text=True,
        check=True,
    )
    return [line.split(" ", 1)[1] for line in done.stderr.splitlines()]


def test_library_notices_are_hidden_unless_verbose():
    assert _stderr() == ["[prompts] wrote prompts@abc", "a warning from Prefect"]
    assert len(_stderr(OPD_VERBOSE="1")) == 5
