"""Export a DFlash drafter in vLLM's `dflash` format, and read an export back.

The format (learnt from vLLM's qwen3_dflash.py, config/speculative.py and the eagle3 aux-layer
helpers): `architectures: ["DFlashDraftModel"]`, `model_type: "qwen3"` with the Qwen3 layer sizes,
`rope_parameters` written explicitly (without it the draft silently uses rope_theta 1e6), and
`dflash_config` {target_layer_ids, mask_token_id, block_size}. Tensor names carry no `model.`
prefix; `lm_head` [Vd, H] and `d2t` (draft vocab offsets) are kept by vLLM when shipped, `t2d` is
skipped by its loader (kept here so an export reads back), `embed_tokens` is not shipped, so the
target's is shared. A target head (`head: "target"`) ships its lm_head [V, H] and no `d2t`: vLLM
sees a full draft vocab, finds the shipped head equal to the target's and shares the target's,
and the export still reads back without the target's head.

`target_layer_ids` use vLLM's layer-output convention: id l is HF `hidden_states[l+1]`, the state
entering layer l+1, so they are this project's aux ids minus one.
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

from models.dflash.model import DEFAULT_HEAD, DFlashConfig, DFlashModel
from models.export_format import (
    CONFIG_FILE,
    PROVENANCE_KEY,
    WEIGHTS_FILE,
    cast_weights,
    dtype_name,
    write_export_dir,
)

ARCHITECTURE = "DFlashDraftModel"


def dflash_config_json(cfg: DFlashConfig, target_identity: Mapping[str, Any] | None) -> dict:
    """The config.json vLLM reads for a DFlash drafter of `cfg`."""
    rope = dict(cfg.rope_parameters)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": rope["rope_theta"],
        "rope_parameters": rope,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "dflash_config": {
            "target_layer_ids": [i - 1 for i in cfg.target_layer_ids],
            "mask_token_id": cfg.mask_token_id,
            "block_size": cfg.block_size,
            "use_aux_hidden_state": True,
        },
        PROVENANCE_KEY: {
            "format_version": 1,
            "drafter_kind": "dflash",
            "target_num_hidden_layers": cfg.target_num_layers,
            "anchors": cfg.anchors,
            "head": cfg.head,
            "target": dict(target_identity) if target_identity else None,
        },
    }


def export_dflash(
    drafter: DFlashModel,
    out_dir: str | os.PathLike,
    *,
    target_identity: Mapping[str, Any] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `config.json` and `model.safetensors` for vLLM's `"method": "dflash"`. A full
    draft vocab ships no `d2t` (vLLM maps draft ids only when the sizes differ)."""
    if not isinstance(drafter, DFlashModel):
        raise ValueError(f"a {drafter.kind} drafter cannot be exported in the dflash format")
    cfg = drafter.config
    tensors = cast_weights(drafter.tensors(), dtype)
    if cfg.draft_vocab_size == cfg.vocab_size:
        del tensors["d2t"], tensors["t2d"]
    config = dflash_config_json(cfg, target_identity)
    config["torch_dtype"] = dtype_name(tensors["fc.weight"])
    return write_export_dir(out_dir, config, tensors)


def read_dflash_export(export_dir: str | os.PathLike) -> tuple[DFlashConfig, dict[str, Tensor]]:
    """Read an `export_dflash` directory: its config and its checkpoint tensors
    (`DFlashDrafter.read_export` builds the drafter from them, with the target's embedding)."""
    export_dir = Path(export_dir)
    config = json.loads((export_dir / CONFIG_FILE).read_text())
    if ARCHITECTURE not in (config.get("architectures") or []):
        raise ValueError(f"{export_dir}: architectures {config.get('architectures')} is not DFlash")
    dflash, ours = config["dflash_config"], config[PROVENANCE_KEY]
    cfg = DFlashConfig(
        hidden_size=config["hidden_size"],
        target_hidden_size=config["target_hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        rms_norm_eps=config["rms_norm_eps"],
        rope_parameters=config["rope_parameters"],
        max_position_embeddings=config["max_position_embeddings"],
        vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        target_layer_ids=tuple(i + 1 for i in dflash["target_layer_ids"]),
        target_num_layers=ours["target_num_hidden_layers"],
        num_layers=config["num_hidden_layers"],
        block_size=dflash["block_size"],
        mask_token_id=dflash["mask_token_id"],
        anchors=ours["anchors"],
        head=ours.get("head", DEFAULT_HEAD),  # exports from before the choice: a draft head
    )
    tensors = load_file(str(export_dir / WEIGHTS_FILE))
    if "d2t" not in tensors:  # a full draft vocab: the identity map
        tensors["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.int64)
        tensors["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    return cfg, tensors
