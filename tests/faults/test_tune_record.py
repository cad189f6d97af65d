"""Issue #40: `opd tune`'s record `<root>/_tune/<NAME-VERSION>.json` under concurrent tunes,
and what a killed tune leaves beside it."""

import json
import subprocess
import sys
import threading

import pytest

import pipeline.core.tuning as tuning
from storage import Store


def test_two_tunes_of_one_drafter_keep_both_results(tmp_path, monkeypatch):
    path = tmp_path / "_tune" / "sft-0123456789ab.json"
    real, reading, second_done = tuning.read_json_object, threading.Event(), threading.Event()

    def slow_read(p):
        value = real(p)
        reading.set()
        second_done.wait(timeout=1.0)  # the second tune records now, if nothing stops it
        return value

    monkeypatch.setattr(tuning, "read_json_object", slow_read)
    path.parent.mkdir()
    path.write_text("{}")
    first = threading.Thread(target=tuning.record_result, args=(path, "T=0.0", {"k": 2}))
    first.start()
    assert reading.wait(timeout=10)  # the first tune has read the file, not yet written it
    monkeypatch.setattr(tuning, "read_json_object", real)
    second = threading.Thread(target=tuning.record_result, args=(path, "T=1.0", {"k": 3}))
    second.start()
    second.join(timeout=0.5)
    second_done.set()
    first.join()
    second.join()
    assert json.loads(path.read_text()) == {"T=0.0": {"k": 2}, "T=1.0": {"k": 3}}


def _dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    return int(p.stdout)


@pytest.mark.parametrize("cleaner", ["tune", "gc"])
def test_a_killed_tunes_temporary_is_removed(tmp_path, cleaner):
    path = tmp_path / "_tune" / "sft-0123456789ab.json"
    path.parent.mkdir()
    dead = path.with_name(f".{path.name}.tmp-{_dead_pid()}")
    dead.write_text('{"T=0.0": ')  # what a kill mid-write leaves
    if cleaner == "tune":
        tuning.record_result(path, "T=0.0", {"k": 2})
        assert json.loads(path.read_text()) == {"T=0.0": {"k": 2}}
    else:
        assert dead in Store(tmp_path).gc()
    assert not dead.exists()
