"""End to end through a real Prefect server: `opd serve`, then `prefect deployment run`.

Starts a server on a free loopback port with a temporary PREFECT_HOME, serves the deployments
from `opd serve`, runs `opd-pipeline/full` on the tiny profile, checks the datasets, re-runs a
single stage, and stops everything it started.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from storage import Store

pytestmark = [pytest.mark.prefect_server, pytest.mark.slow]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def prefect_env(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = os.environ | {
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_API_URL": url,
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "PREFECT_LOGGING_LEVEL": "INFO",
        # `opd serve` looks for scheduled runs every second, not every 10: four runs' waits
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
    }
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait(lambda: _healthy(url), 180, "the Prefect server")
        yield env, tmp_path
    finally:
        _stop(server)
        log.close()


def _deploy_run(env, *params: str, timeout: int = 900) -> subprocess.CompletedProcess:
    args = [str(BIN / "prefect"), "deployment", "run", "opd-pipeline/full"]
    args += ["--watch", "--watch-interval", "1"]
    for p in params:
        args += ["--param", p]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)


def _committed(store: Store) -> dict[str, str]:
    return {f"{r['name']}@{r['version']}": r["created"] for r in store.listing() if r["complete"]}


def test_serve_full_deployment_and_single_stage_rerun(prefect_env):
    env, tmp = prefect_env
    root = tmp / "data"
    # no server reachable -> a clear message
    bad = subprocess.run(
        [str(BIN / "opd"), "--root", str(root), "serve"],
        env=env | {"PREFECT_API_URL": "http://127.0.0.1:9/api"},
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "prefect server start" in bad.stderr

    serve_log = open(tmp / "serve.log", "w")
    served = subprocess.Popen(
        [str(BIN / "opd"), "--root", str(root), "serve"],
        env=env,
        stdout=serve_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:

        def deployed() -> bool:
            r = subprocess.run(
                [str(BIN / "prefect"), "deployment", "inspect", "opd-pipeline/full"],
                env=env,
                capture_output=True,
                text=True,
            )
            return r.returncode == 0

        _wait(deployed, 180, "opd serve to register opd-pipeline/full")

        run = _deploy_run(env, "profile=tiny", "run_name=ci")
        assert run.returncode == 0, run.stdout + run.stderr
        store = Store(root)
        first = _committed(store)
        names = {k.split("@")[0] for k in first}
        assert names == {
            "prompts",
            "trajectories",
            "features",
            "sft",
            "rollouts",
            "replays",
            "opd",
            "eval",
        }, first
        for ref in first:
            store.open(ref).verify_all()
        assert list((root / "_exports").glob("opd-*/eagle3/config.json"))
        last_rollout = store.resolve("rollouts@run:ci")  # the last round's rollout
        produced = json.loads((root / "_runs" / "ci.json").read_text())["datasets"]

        # re-run one stage on cached shards with a changed setting: it and its dependants run
        run = _deploy_run(
            env,
            "profile=tiny",
            "run_name=ci",
            'stages=["score-r1"]',
            'overrides=["score.accepted_share=0.5"]',
        )
        assert run.returncode == 0, run.stdout + run.stderr
        second = _committed(store)
        assert all(second[k] == first[k] for k in first)  # nothing was rewritten in place
        rerun = json.loads((root / "_runs" / "ci.json").read_text())["datasets"]
        changed = {k for k in produced if rerun[k] != produced[k]}
        upstream = {"prompts", "generate", "features", "sft", "rollout-r1"}
        assert not changed & upstream, changed
        assert {"score-r1", "opd-r1", "rollout-r2", "score-r2", "opd-r2", "evaluate"} <= changed
        assert last_rollout != store.resolve("rollouts@run:ci")

        # bad parameters fail at once, naming the parameter
        run = _deploy_run(env, "profile=nope", timeout=300)
        assert run.returncode != 0 and "profile" in (run.stdout + run.stderr)
        run = _deploy_run(env, "bogus=1", timeout=300)
        assert run.returncode != 0 and "bogus" in (run.stdout + run.stderr)
    finally:
        _stop(served)
        serve_log.close()
