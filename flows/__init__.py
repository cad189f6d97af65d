"""Prefect wiring only: flows, tasks, deployments. No tensors, no stage logic."""

import os

# The stages log to "opd"; Prefect sends that logger's lines to the flow run (the UI) as well.
# Set before Prefect is imported, which is when it configures logging.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "opd")
# A stage run outside a flow (a test, a REPL, `opd run` without --prefect) in a process that has
# imported flows/ logs to "opd" with no flow run to attach the line to; Prefect would warn on
# each such line. The line still reaches the console; only the API copy is dropped.
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
