"""Prefect wiring only: flows, tasks, deployments. No tensors, no stage logic."""

import os

# The stages log to "opd"; Prefect sends that logger's lines to the flow run (the UI) as well.
# Set before Prefect is imported, which is when it configures logging.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "opd")
