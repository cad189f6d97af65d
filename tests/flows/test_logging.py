"""Logging through flows/ outside a flow run: the line shows, Prefect's warning does not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import logging, warnings
warnings.simplefilter("error")  # any warning fails the script
import flows.pipeline
logging.getLogger("opd").warning("a stage line outside any flow")
"""


def test_a_stage_line_outside_a_flow_run_is_logged_without_prefects_warning():
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "a stage line outside any flow" in done.stderr
    assert "without a flow run id" not in done.stderr
