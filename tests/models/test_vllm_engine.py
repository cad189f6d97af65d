"""models/vllm_engine.py's own logic, without starting an engine."""

from __future__ import annotations

import json
import logging
import os
import shlex
import stat
import sys
from types import SimpleNamespace

from models import vllm_engine
from models.vllm_engine import (
    EngineSpec,
    SpecCounters,
    _quiet_known_noise,
    _request_counters,
    _root_cause,
    _start_failure,
    _stderr_tail,
)


def test_counters_come_from_each_requests_acceptance_histogram():
    # 4 verify steps: 0, 2, 2 and 6 drafts accepted (K=6)
    metrics = SimpleNamespace(histogram=[1, 0, 2, 0, 0, 0, 1], num_draft_tokens=24)
    one = _request_counters(metrics, 6)
    assert one == SpecCounters(4, 24, 10, (3, 3, 1, 1, 1, 1))
    assert one.tau == 3.5
    assert one + _request_counters(None, 6) == one


CHILD_LOG = """\
(EngineCore pid=7) ERROR 11-23 02:00:01 [core.py:1100] EngineCore failed to start.
(EngineCore pid=7) ERROR 11-23 02:00:01 [core.py:1100] Traceback (most recent call last):
(EngineCore pid=7) ERROR 11-23 02:00:01 [core.py:1100]   File "core.py", line 1, in run
(EngineCore pid=7) ERROR 11-23 02:00:01 [core.py:1100] ValueError: To serve at least one request \
with the models's max seq len (1000000), (11.44 GiB KV cache is needed, which is larger than the \
available KV cache memory (1.0 GiB).
"""


def test_a_start_failure_in_the_engine_process_is_quoted_from_its_log():
    tail = CHILD_LOG.splitlines()
    assert _root_cause(tail).startswith("ValueError: To serve at least one request")
    err = RuntimeError(
        "Engine core initialization failed. See root cause above. Failed core proc(s): {}"
    )
    msg = str(_start_failure(EngineSpec("/m"), err, tail))
    assert "VLLM_CPU_KVCACHE_SPACE" in msg and "11.44 GiB" in msg and "\n" not in msg


def test_a_refusal_names_the_drafter_export():
    err = ValueError("Model architectures ['X'] are not supported\nfor now.")
    msg = str(_start_failure(EngineSpec("/m", drafter="/exports/d", k=2, method="eagle3"), err, []))
    assert msg.startswith("vLLM refused the drafter export /exports/d: ValueError: Model")
    assert "\n" not in msg


def test_only_the_chat_template_warmup_warning_is_dropped():
    # engines skip the tokenizer, so vLLM's chat-template warm-up always fails, harmlessly.
    # Asked of the logger itself: once vllm is imported its loggers stop propagating to root.
    _quiet_known_noise()
    _quiet_known_noise()  # idempotent: one filter however many engines start
    logger = logging.getLogger("vllm.renderers.base")
    assert len(logger.filters) == 1

    def record(msg: str) -> logging.LogRecord:
        return logger.makeRecord(logger.name, logging.WARNING, __file__, 1, msg, (), None)

    assert not logger.filter(record("Chat template warmup failed"))
    assert logger.filter(record("Something else failed"))


def test_the_engine_log_is_created_as_a_plain_file(tmp_path):
    log = tmp_path / "vllm.log"
    with _stderr_tail(log):
        os.write(2, b"INFO an engine line\n")
    plain = tmp_path / "plain.txt"
    plain.write_text("")  # how the project writes its other files: 0o666 less the umask
    assert stat.S_IMODE(log.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)
    assert not log.stat().st_mode & 0o111  # was 0755: os.open's default mode is 0o777


def test_the_serve_command_is_what_the_engine_is_started_with(monkeypatch):
    monkeypatch.setattr(vllm_engine, "device", lambda: "cpu")
    eagle = vllm_engine.EngineSpec("/m/target", "float32", "/m/drafter", 2, method="eagle3")
    spec = vllm_engine.speculative_config(eagle)
    assert spec == {"method": "eagle3", "model": "/m/drafter", "num_speculative_tokens": 2}
    command = vllm_engine.serve_command(eagle)
    assert shlex.split(command) == [
        *("vllm", "serve", "/m/target", "--dtype", "float32", "--seed", "0", "--enforce-eager"),
        *("--speculative-config", json.dumps(spec)),
    ]
    sizes = (("prompt_lookup_max", 4), ("prompt_lookup_min", 2))
    lookup = vllm_engine.EngineSpec("/m/target", "bfloat16", None, 4, method="ngram", options=sizes)
    assert vllm_engine.speculative_config(lookup) == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
    plain = shlex.split(vllm_engine.serve_command(vllm_engine.EngineSpec("/m/target", "bfloat16")))
    assert "--speculative-config" not in plain and plain[4] == "bfloat16"
    monkeypatch.setattr(vllm_engine, "device", lambda: "cuda")
    assert "--enforce-eager" not in vllm_engine.serve_command(eagle)


def test_an_engine_start_leaves_this_processs_environment_as_it_was(monkeypatch, tmp_path):
    # vLLM's CPU platform writes its engine processes' settings (LD_PRELOAD of tcmalloc and
    # libgomp, LOCAL_WORLD_SIZE) into os.environ as the engine starts; left there, every later
    # child of the process runs under them (a test suite's `opd run` child peaked 3.37 GiB
    # under tcmalloc against 2.2 GB alone), so results depended on which tests ran before.
    class WritesTheEnvironment:
        def __init__(self, fail: bool, **kwargs):
            os.environ["LD_PRELOAD"] = "/vllm/libtcmalloc.so"
            os.environ["LOCAL_WORLD_SIZE"] = "1"
            if fail:
                raise ValueError("no room for the KV cache")

    started = []

    def fake_llm(**kwargs):
        started.append(kwargs["model"])
        return WritesTheEnvironment(fail=kwargs["model"] == "/m/fails", **kwargs)

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=fake_llm))
    monkeypatch.setattr(vllm_engine, "_require", lambda: None)
    monkeypatch.setattr(vllm_engine, "unsupported_reason", lambda model: None)
    monkeypatch.setattr(vllm_engine, "device", lambda: "cpu")
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    before = dict(os.environ)
    for model in ("/m/fails", "/m/starts"):
        spec = EngineSpec(model, "float32")
        try:
            vllm_engine.engine(spec, tmp_path / "vllm.log")
        except vllm_engine.VllmError:
            assert model == "/m/fails"
        finally:
            vllm_engine._ENGINES.pop(spec, None)
            vllm_engine._ENGINE_PROCESSES.pop(spec, None)
            vllm_engine._ENGINE_SOCKETS.pop(spec, None)
            vllm_engine._ENGINE_LOGS.pop(spec, None)
        assert dict(os.environ) == before, model
    assert started == ["/m/fails", "/m/starts"]
