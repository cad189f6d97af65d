"""Export a Medusa drafter in vLLM's Medusa format, and read an export back.

The format (learnt from vLLM 0.32's model_executor/models/medusa.py, transformers_utils/configs/
medusa.py, config/speculative.py and v1/spec_decode/medusa.py): `architectures: ["MedusaModel"]`,
`model_type: "medusa"`, `hidden_size`, `vocab_size`, `num_heads`, `num_hidden_layers` (residual
blocks per head), `medusa_fc_bias: false`; tensors `blocks.{i}.layers.{j}.weight` [H, H] and
`lm_heads.{i}.weight` [V, H]. vLLM feeds head i the target's final post-norm hidden state at the
position that produced the last sampled token and drafts head i's argmax as the (i+1)-th token
after that one: this project's head i+1 (models/medusa/model.py), so no offset shifts.

Full-vocabulary heads. vLLM builds every head with the target's vocab_size rows and its pruned
vocab (`token_map` with `truncated_vocab_size`) does not load: `load_weights` cuts a shipped
head to the token_map's rows, then the weight loader asserts the target's row count (and a
head shipped with the draft vocab's rows fails the same assertion; both stop vLLM 0.32's CPU
engine with that AssertionError). `original_lm_head: true` does load a pruned head, but one
head shared by every Medusa head, which these are not. So the export widens each
[Vd, H] head to [V, H]: draft token d's row at its target id, and every other row the centroid
(mean) of the head's draft rows. The heads have no bias, so no row can sit below the others
for every state; a centroid's logit is the mean of the draft logits, never above their max,
equal only when every draft logit is equal (up to rounding: a head flat over the whole draft
vocab), where vLLM's argmax takes the lowest id. So vLLM drafts the draft-vocab argmax this
project drafts. Serving memory is vLLM's own V-row heads whatever is shipped.

`d2t` / `t2d` are shipped too (vLLM skips tensors it has no parameter for) so the export reads
back to the drafter's exact draft vocab; a non-draft row that is not the centroid is refused on
read. vLLM builds `num_speculative_tokens` heads and skips the checkpoint's later ones.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from models.export_format import (
    CONFIG_FILE,
    PROVENANCE_KEY,
    WEIGHTS_FILE,
    ExportError,
    dtype_name,
    write_export_dir,
)
from models.kind_config import hf_config_dict
from models.medusa.model import MedusaConfig, MedusaHeads
from models.vocab import DraftVocab

ARCHITECTURE = "MedusaModel"
VOCAB_KEYS = ("d2t", "t2d")


def medusa_config_json(cfg: MedusaConfig, target_identity: Mapping[str, Any] | None) -> dict:
    """The config.json vLLM reads for a Medusa drafter of `cfg`. vLLM's MedusaConfig renames
    every top-level key holding "num" and "heads" / "layers", so nothing else there does."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "medusa",
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "truncated_vocab_size": cfg.vocab_size,  # full-vocabulary heads (module docstring)
        "num_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers,
        "medusa_fc_bias": False,
        PROVENANCE_KEY: {
            "format_version": 1,
            "drafter_kind": "medusa",
            "draft_vocab_size": cfg.draft_vocab_size,
            "target": dict(target_identity) if target_identity else None,
        },
    }


def full_vocab_head(head: Tensor, vocab: DraftVocab) -> Tensor:
    """A [Vd, H] draft-vocab head as vLLM's [V, H] one: draft rows at their target ids, every
    other row their centroid (module docstring)."""
    centroid = head.double().mean(dim=0).to(head.dtype)
    full = centroid.expand(vocab.vocab_size, -1).clone()
    full[vocab.draft_to_target_ids.to(head.device)] = head
    return full


def check_export_invariants(drafter: MedusaHeads, target_config: Any) -> None:
    """Raise ExportError naming the first invariant vLLM depends on that `drafter` breaks for
    its target (vLLM replaces the drafter's vocab size with the target's and feeds it states of
    the target's width)."""
    target = hf_config_dict(target_config)
    cfg = drafter.config
    for name, ours, theirs in (
        ("vocab size", cfg.vocab_size, target["vocab_size"]),
        ("hidden size", cfg.hidden_size, target["hidden_size"]),
    ):
        if ours != theirs:
            raise ExportError(f"{name}: the drafter's is {ours}, the target's {theirs}")
    try:
        vocab = DraftVocab(drafter.d2t, drafter.t2d)
    except ValueError as err:
        raise ExportError(f"draft vocab map: {err}") from None
    if vocab.vocab_size != cfg.vocab_size or vocab.draft_vocab_size != cfg.draft_vocab_size:
        raise ExportError(
            f"draft vocab map: {vocab.draft_vocab_size} of {vocab.vocab_size} ids, the config "
            f"says {cfg.draft_vocab_size} of {cfg.vocab_size}"
        )


def export_medusa(
    drafter: MedusaHeads,
    out_dir: str | os.PathLike,
    *,
    target_config: Any | None = None,
    target_identity: Mapping[str, Any] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `config.json` and `model.safetensors` for vLLM's `"method": "medusa"`."""
    if not isinstance(drafter, MedusaHeads):
        raise ExportError(f"a {drafter.kind} drafter cannot be exported in the medusa format")
    if target_config is not None:
        check_export_invariants(drafter, target_config)
    cfg, vocab = drafter.config, DraftVocab(drafter.d2t.cpu(), drafter.t2d.cpu())

    def shipped(t: Tensor) -> Tensor:  # cast before widening: the centroid is the shipped rows'
        return (t.to(dtype) if dtype is not None else t).detach().cpu().contiguous()

    tensors: dict[str, Tensor] = {}
    for i, (block, head) in enumerate(zip(drafter.blocks, drafter.heads, strict=True)):
        for j, layer in enumerate(block):
            tensors[f"blocks.{i}.layers.{j}.weight"] = shipped(layer.linear.weight)
        tensors[f"lm_heads.{i}.weight"] = full_vocab_head(shipped(head.weight), vocab)
    tensors |= {name: getattr(drafter, name).detach().cpu().contiguous() for name in VOCAB_KEYS}
    config = medusa_config_json(cfg, target_identity)
    config["torch_dtype"] = dtype_name(tensors["lm_heads.0.weight"])
    return write_export_dir(out_dir, config, tensors)


def read_medusa_export(export_dir: str | os.PathLike) -> tuple[MedusaConfig, dict[str, Tensor]]:
    """Read an `export_medusa` directory: its config and the drafter's checkpoint tensors
    (`MedusaDrafter.from_tensors` names); ExportError names what is missing or corrupt."""
    export_dir = Path(export_dir)
    try:
        config = json.loads((export_dir / CONFIG_FILE).read_text())
    except (OSError, ValueError) as err:
        raise ExportError(
            f"{export_dir / CONFIG_FILE} is not readable JSON ({err}); re-export the drafter"
        ) from None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if ARCHITECTURE not in (architectures or []):
        raise ExportError(f"{export_dir}: architectures {architectures} is not Medusa")
    try:
        cfg = MedusaConfig(
            hidden_size=config["hidden_size"],
            vocab_size=config["vocab_size"],
            draft_vocab_size=config[PROVENANCE_KEY]["draft_vocab_size"],
            num_heads=config["num_heads"],
            num_layers=config["num_hidden_layers"],
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ExportError(f"{export_dir}: {CONFIG_FILE} is no Medusa config ({err})") from None
    try:
        shipped = load_file(str(export_dir / WEIGHTS_FILE))
    except (OSError, ValueError, RuntimeError) as err:
        raise ExportError(f"{export_dir}: {WEIGHTS_FILE} is unreadable ({err})") from None
    expected = {
        *VOCAB_KEYS,
        *(
            f"blocks.{i}.layers.{j}.weight"
            for i in range(cfg.num_heads)
            for j in range(cfg.num_layers)
        ),
        *(f"lm_heads.{i}.weight" for i in range(cfg.num_heads)),
    }
    missing, unexpected = sorted(expected - set(shipped)), sorted(set(shipped) - expected)
    if missing or unexpected:
        raise ExportError(
            f"{export_dir}: missing tensors {missing}, unexpected tensors {unexpected}"
        )
    try:
        vocab = DraftVocab(shipped["d2t"], shipped["t2d"])
    except ValueError as err:
        raise ExportError(f"{export_dir}: draft vocab map (d2t, t2d): {err}") from None
    if (vocab.vocab_size, vocab.draft_vocab_size) != (cfg.vocab_size, cfg.draft_vocab_size):
        raise ExportError(
            f"{export_dir}: d2t / t2d map {vocab.draft_vocab_size} of {vocab.vocab_size} ids, "
            f"the config {cfg.draft_vocab_size} of {cfg.vocab_size}"
        )
    H = cfg.hidden_size
    tensors: dict[str, Tensor] = {name: shipped[name] for name in VOCAB_KEYS}
    for i in range(cfg.num_heads):
        for j in range(cfg.num_layers):
            name = f"blocks.{i}.layers.{j}.weight"
            _check_shape(export_dir, name, shipped[name], (H, H))
            tensors[f"blocks.{i}.{j}.linear.weight"] = shipped[name]
        name = f"lm_heads.{i}.weight"
        full = shipped[name]
        _check_shape(export_dir, name, full, (cfg.vocab_size, H))
        head = full[vocab.draft_to_target_ids]
        # the centroid up to its rounding (a mean's last bit may differ between machines)
        slack = 4 * torch.finfo(full.dtype).eps * float(head.abs().max())
        if not torch.allclose(full.double(), full_vocab_head(head.double(), vocab), 0, slack):
            raise ExportError(
                f"{export_dir}: tensor {name!r} is corrupt: its non-draft rows are not the "
                "centroid of its draft rows, so vLLM could draft tokens outside the draft vocab"
            )
        tensors[f"heads.{i}.weight"] = head.contiguous()
    return cfg, tensors


def _check_shape(export_dir: Path, name: str, t: Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ExportError(
            f"{export_dir}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}"
        )
