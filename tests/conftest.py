"""Test-wide settings: tests run on CPU with tiny models; one thread keeps them predictable."""

import logging
import os
import sys

import pytest
import torch

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
torch.set_num_threads(1)
# What every test starts from: a test (or a library it drives, as vLLM's CPU platform writing
# LD_PRELOAD) that changes the environment or torch's threads must not reach the next one or
# the processes it starts, so results do not depend on order or on how workers share tests.
_ENVIRON = dict(os.environ)


def pytest_addoption(parser):
    parser.addoption(
        "--reverse-order",
        action="store_true",
        help="run the tests in reverse order (the suite's check that no test depends on another)",
    )


@pytest.fixture(autouse=True)
def _restore_process_state():
    yield
    for name in set(os.environ) - set(_ENVIRON):
        if not name.startswith("PYTEST_"):  # pytest's own (PYTEST_CURRENT_TEST), it unsets
            del os.environ[name]
    os.environ.update(_ENVIRON)
    torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups to schedule by
def pytest_collection_modifyitems(config, items):
    """Under `pytest -n 2 --dist loadgroup` (make test): a test file's tests run in one worker,
    so a module's fixtures are built once, and every test that starts a vLLM engine runs in one
    worker, which builds the session's engines (30-50 s each) once."""
    for item in items:
        group = "vllm" if item.get_closest_marker("vllm") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
    # Longest first, so neither worker is left alone with a long group at the end: the vLLM
    # group (engine starts, two trained drafters, ~10 min), then the `slow` modules, then the
    # rest. A stable sort keeps every module's own order.
    if config.getoption("--reverse-order"):
        items.reverse()  # each module's own order reversed too; the groups below stay
    items.sort(
        key=lambda item: (
            item.get_closest_marker("vllm") is None,
            item.get_closest_marker("slow") is None,
        )
    )


def pytest_sessionfinish(session, exitstatus):
    """Shut Prefect's temporary API server down while pytest's streams are still open. Left to
    its atexit handler, it logs "Stopping temporary server" into the stream pytest has closed
    by then, and its log and event workers post to a server already gone: the run would end
    with "--- Logging error ---" tracebacks after pytest's summary."""
    server = sys.modules.get("prefect.server.api.server")
    if server is None or not server.SubprocessASGIServer._instances:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=5)  # deliver what is queued while the server still answers
    logging.getLogger("prefect").setLevel(logging.WARNING)  # the stop message is not news
    for instance in list(server.SubprocessASGIServer._instances.values()):
        instance.stop()
