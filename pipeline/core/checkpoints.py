"""`Checkpointer`: weights, optimizer, scheduler, RNG and loop state as safetensors + JSON (never
pickle), so a resumed run continues bit-for-bit where the saved one stopped."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save
from torch import Tensor
from torch.distributed.tensor import DTensor

from pipeline.core.ranks import shard_like
from storage import OpdError, disk_error

if TYPE_CHECKING:
    from pipeline.core.training import WarmupCosine

_CKPT_TENSORS = "tensors.safetensors"
_CKPT_STATE = "state.json"
_CKPT_SUMS = "checksums.json"
_CKPT_FORMAT = 1
_log = logging.getLogger("opd")


@dataclass
class Checkpoint:
    """What `Checkpointer.load` returns; the optimizer/scheduler/RNG parts are restored by it."""

    step: int
    model: dict[str, Tensor]
    state: dict[str, Any]  # the caller's loop state (data position, metrics so far, ...)


def _rng_state() -> tuple[dict[str, Tensor], dict[str, Any]]:
    tensors = {"rng/torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{i}"] = s
    version, mt, gauss = random.getstate()
    return tensors, {"python": [version, list(mt), gauss]}


def _set_rng_state(tensors: Mapping[str, Tensor], state: Mapping[str, Any]) -> None:
    torch.set_rng_state(tensors["rng/torch"])
    cuda = sorted(
        (k for k in tensors if k.startswith("rng/cuda/")), key=lambda k: int(k.split("/")[-1])
    )
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))


def _optimizer_parts(sd: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, entry in sd["state"].items():
        for key, value in entry.items():
            if isinstance(value, Tensor):
                tensors[f"optim/{idx}/{key}"] = value.detach().contiguous()
            else:
                scalars.setdefault(str(idx), {})[key] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_state(
    tensors: Mapping[str, Tensor], parts: Mapping[str, Any], params: Sequence[Tensor]
) -> dict[str, Any]:
    """The optimizer's state_dict from a checkpoint; a moment of an FSDP-sharded parameter
    `params[i]` becomes this rank's shard of it, as the optimizer holds it."""
    state: dict[int, dict[str, Any]] = {}
    for name, t in tensors.items():
        if name.startswith("optim/"):
            _, idx, key = name.split("/", 2)
            param = params[int(idx)]
            if isinstance(param, DTensor) and t.shape == param.shape:  # not the scalar `step`
                t = shard_like(t, param)
            state.setdefault(int(idx), {})[key] = t
    for idx, entry in parts["scalars"].items():
        state.setdefault(int(idx), {}).update(entry)
    return {"state": state, "param_groups": parts["param_groups"]}


class Checkpointer:
    """Numbered checkpoints under `directory`: `step-00000120/` holding `tensors.safetensors`,
    `state.json` and `checksums.json` (the sha256 of the other two).

    Each is written into a hidden temporary directory, fsynced and renamed into place, so a kill
    at any moment leaves the previous checkpoints intact. The newest `keep` are kept. A
    checkpoint that fails its checksums is never resumed from: `latest()` sets it aside with a
    warning and offers the one before, so a flipped byte cannot be trained on and then rotate
    the good checkpoints out.
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 2):
        if keep < 1:
            raise OpdError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep

    def _steps(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        return sorted(
            int(p.name[5:])
            for p in self.directory.iterdir()
            if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit()
        )

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}"

    def latest(self) -> int | None:
        """The newest checkpoint whose files match their checksums, or None (a fresh start).

        One that fails is renamed to `.step-N.corrupt-PID` (kept for inspection; it goes with
        the work directory when the stage commits) and a warning names it."""
        for step in reversed(self._steps()):
            path = self.path(step)
            _, problem = self._read(path)
            if problem is None:
                return step
            aside = self.directory / f".{path.name}.corrupt-{os.getpid()}"
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(path, aside)
            _log.warning(
                "checkpoint %s %s: set aside as %s; using the checkpoint before it, if any",
                path,
                problem,
                aside.name,
            )
        return None

    def _read(self, path: Path) -> tuple[dict[str, bytes], str | None]:
        """The checkpoint's files and what is wrong with them (None: all match their checksums)."""
        try:
            sums = json.loads((path / _CKPT_SUMS).read_bytes())
            files = {name: (path / name).read_bytes() for name in (_CKPT_TENSORS, _CKPT_STATE)}
        except (OSError, ValueError) as e:
            return {}, f"is unreadable ({e})"
        for name, data in files.items():
            if not isinstance(sums, dict) or sums.get(name) != hashlib.sha256(data).hexdigest():
                return files, f"is corrupted: {name} fails its sha256 check"
        return files, None

    def save(
        self,
        step: int,
        *,
        model: Mapping[str, Tensor],
        optimizer: torch.optim.Optimizer | Mapping[str, Any],
        scheduler: WarmupCosine,
        state: Mapping[str, Any],
    ) -> Path:
        """Write checkpoint `step`: model tensors, optimizer, scheduler, RNG and `state` (JSON).

        `optimizer` is the optimizer or its state_dict with whole tensors (under FSDP every rank
        gathers it, `full_optimizer_state`, and rank 0 saves: the files are the same either way)."""
        sd = optimizer.state_dict() if isinstance(optimizer, torch.optim.Optimizer) else optimizer
        optim_tensors, optim_parts = _optimizer_parts(sd)
        rng_tensors, rng_parts = _rng_state()
        tensors = {f"model/{k}": v.detach().contiguous() for k, v in model.items()}
        tensors |= optim_tensors | rng_tensors
        doc = {
            "format": _CKPT_FORMAT,
            "step": step,
            "optimizer": optim_parts,
            "scheduler": scheduler.state_dict(),
            "rng": rng_parts,
            "state": dict(state),
        }
        # Serialised in memory and written here: safetensors' own file writer reports no error
        # on a full disk, and the checksums must be of the bytes meant, not of what landed.
        files = {_CKPT_TENSORS: safetensors_save(tensors), _CKPT_STATE: json.dumps(doc).encode()}
        files[_CKPT_SUMS] = json.dumps(
            {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
        ).encode()
        final = self.path(step)
        tmp = self.directory / f".step-{step:08d}.tmp-{os.getpid()}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for name, data in files.items():
                with open(tmp / name, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise disk_error(
                e,
                f"checkpoint {final}",
                kept="earlier checkpoints are kept and a re-run resumes from the newest",
            ) from e
        for old in self._steps()[: -self.keep]:
            shutil.rmtree(self.path(old), ignore_errors=True)
        return final

    def load(
        self,
        step: int,
        *,
        optimizer: torch.optim.Optimizer,
        scheduler: WarmupCosine,
        restore_rng: bool = True,
    ) -> Checkpoint:
        """Restore optimizer, scheduler and RNG from checkpoint `step`; return its model and state."""
        path = self.path(step)
        files, problem = self._read(path)
        if problem is not None:
            raise OpdError(f"checkpoint {path} {problem}; delete it to resume from an earlier one")
        doc = json.loads(files[_CKPT_STATE])
        tensors = safetensors_load(files[_CKPT_TENSORS])
        if doc.get("format") != _CKPT_FORMAT:
            raise OpdError(
                f"checkpoint {path} has format {doc.get('format')}, expected {_CKPT_FORMAT}"
            )
        params = [p for group in optimizer.param_groups for p in group["params"]]
        optimizer.load_state_dict(_optimizer_state(tensors, doc["optimizer"], params))
        scheduler.load_state_dict(doc["scheduler"])
        if restore_rng:
            _set_rng_state(tensors, doc["rng"])
        model = {k[6:]: v for k, v in tensors.items() if k.startswith("model/")}
        return Checkpoint(step=doc["step"], model=model, state=doc["state"])

    def clear(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
