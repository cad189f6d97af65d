"""EAGLE-3 exports: vLLM's native EAGLE-3 layout and the speculators layout (the generic entry
points, for any drafter kind, are in models/export.py).

Key names verified against vLLM (vllm/model_executor/models/llama_eagle3.py: `midlayer.` ->
`layers.0.`, `d2t` -> draft_id_to_target_id, `t2d` skipped, `target_hidden_size`, `draft_vocab_size`,
`eagle_config.use_aux_hidden_state`; vllm/v1/worker/gpu_model_runner.py
`_get_eagle3_aux_layers_from_config`: `eagle_aux_hidden_state_layer_ids` at the top level, then under
`eagle_config`; vllm/transformers_utils/configs/speculators/{base,algos}.py: `speculators_model_type`,
`speculators_config.proposal_methods[0].speculative_tokens`, `speculators_config.verifier.name_or_path`,
`transformer_layer_config`, and `norm_before_residual` defaulting to TRUE when absent) and the
speculators repo (src/speculators/models/eagle3/config.py, convert/eagle/eagle3_converter.py).

Every known way an export loads but accepts nothing is checked before anything is written:
aux-layer ids missing, out of the HF/vLLM range, out of order or repeated, a broken vocab map, an
fc sized for another target, a foreign embedding, a short-context or different rope, a target
family vLLM's EAGLE-3 refuses. The speculators export carries its own `embed_tokens.weight`
(the target's), so no loader has to be trusted to copy it from the verifier; the native export
leaves it out, as vLLM shares the target's.
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

from models.eagle3.model import Eagle3Config, Eagle3Model
from models.export_format import (
    CONFIG_FILE,
    PROVENANCE_KEY,
    WEIGHTS_FILE,
    ExportError,
    cast_weights,
    dtype_name,
    write_export_dir,
)
from models.kind_config import hf_config_dict
from models.layers import rope_parameters_of
from models.target import check_aux_layer_ids
from models.vocab import DraftVocab

NATIVE_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
EMBED_KEY = "embed_tokens.weight"
# vLLM's EAGLE-3 target families (vllm/config/speculative.py), matched as substrings of the
# target's model_type as vLLM does; any other target is refused when vLLM starts.
VLLM_EAGLE3_TARGET_FAMILIES = (
    "llama",
    "qwen",
    "minicpm",
    "gpt_oss",
    "hunyuan_vl",
    "hunyuan_v1_dense",
    "afmoe",
)


def check_export_invariants(
    drafter: Eagle3Model,
    target_config: Any,
    target_embed_weight: Tensor | None = None,
) -> None:
    """Raise ExportError naming the first violated invariant between `drafter` and its target."""
    target = hf_config_dict(target_config)
    cfg = drafter.config
    num_layers, hidden, vocab_size = (
        target["num_hidden_layers"],
        target["hidden_size"],
        target["vocab_size"],
    )
    try:
        check_aux_layer_ids(cfg.aux_layer_ids, num_layers)
    except ValueError as err:
        raise ExportError(f"aux layer ids: {err}") from None
    if cfg.target_num_layers != num_layers:
        raise ExportError(
            f"aux layer ids: the drafter was built for a {cfg.target_num_layers}-layer target, this one has {num_layers}"
        )
    try:
        vocab = DraftVocab(drafter.d2t, drafter.t2d)
    except ValueError as err:
        raise ExportError(f"draft vocab map: {err}") from None
    if vocab.vocab_size != vocab_size or vocab.draft_vocab_size != cfg.draft_vocab_size:
        raise ExportError(
            f"draft vocab map: t2d covers {vocab.vocab_size} target ids and d2t {vocab.draft_vocab_size} draft ids; "
            f"expected the target's {vocab_size} and draft_vocab_size {cfg.draft_vocab_size}"
        )
    if tuple(drafter.lm_head.weight.shape) != (cfg.draft_vocab_size, cfg.hidden_size):
        raise ExportError(
            f"lm_head is {tuple(drafter.lm_head.weight.shape)}, expected [{cfg.draft_vocab_size}, {cfg.hidden_size}]"
        )
    if tuple(drafter.fc.weight.shape) != (cfg.hidden_size, 3 * hidden):
        raise ExportError(
            f"fc input: fc.weight is {tuple(drafter.fc.weight.shape)} but the target's hidden size {hidden} "
            f"needs [{cfg.hidden_size}, {3 * hidden}] (3 * H_target inputs)"
        )
    if cfg.hidden_size != hidden:
        raise ExportError(
            f"embedding: the drafter's hidden size {cfg.hidden_size} differs from the target's {hidden}; "
            "vLLM feeds the target's embeddings to the drafter"
        )
    embed = drafter.embed_tokens.weight
    if tuple(embed.shape) != (vocab_size, hidden):
        raise ExportError(
            f"embedding: the drafter's embedding is {tuple(embed.shape)}, the target's is [{vocab_size}, {hidden}]"
        )
    if target_embed_weight is not None and not torch.equal(
        embed.detach().cpu(), target_embed_weight.detach().cpu()
    ):
        raise ExportError(
            "embedding: the drafter's embedding is not the target's own (trained against another checkpoint?); "
            "vLLM will use the target's embedding"
        )
    model_type = str(target.get("model_type", ""))
    if not any(family in model_type for family in VLLM_EAGLE3_TARGET_FAMILIES):
        raise ExportError(
            f"target family: vLLM's EAGLE-3 refuses {model_type or 'unknown'!r} targets at start-up; "
            f"it supports {', '.join(VLLM_EAGLE3_TARGET_FAMILIES)}: train the drafter for one of those"
        )
    rope = rope_parameters_of(target)
    if cfg.rope_parameters != rope:
        raise ExportError(
            f"rope: the drafter uses {cfg.rope_parameters}, the target {rope}; copy the target's rope"
        )
    if cfg.max_position_embeddings != target["max_position_embeddings"]:
        raise ExportError(
            f"max positions: the drafter has {cfg.max_position_embeddings}, the target "
            f"{target['max_position_embeddings']}; a shorter drafter context caps vLLM's context or drafts badly"
        )


def _layer_config(cfg: Eagle3Config) -> dict[str, Any]:
    """The Llama decoder-layer fields vLLM reads, rope in both the transformers-4 and -5 spellings."""
    rope = dict(cfg.rope_parameters)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": scaling if scaling.get("rope_type", "default") != "default" else None,
        "rope_parameters": rope,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }


def _provenance(cfg: Eagle3Config, target_identity: Mapping[str, Any] | None) -> dict[str, Any]:
    return {
        "format_version": 1,
        "drafter_kind": "eagle3",
        "target_num_hidden_layers": cfg.target_num_layers,
        "target": dict(target_identity) if target_identity else None,
    }


def export_eagle3(
    drafter: Eagle3Model,
    target_config: Any,
    out_dir: str | os.PathLike,
    *,
    target_identity: Mapping[str, Any] | None = None,
    target_embed_weight: Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write vLLM's native EAGLE-3 directory (architectures ["LlamaForCausalLMEagle3"]).

    Tensors: fc.weight, midlayer.*, norm.weight, lm_head.weight [Vd, H], d2t int64, t2d bool; no
    embed_tokens (vLLM shares the target's). `target_config` is the target's HF config (or its dict).
    """
    check_export_invariants(drafter, target_config, target_embed_weight)
    cfg = drafter.config
    tensors = cast_weights(drafter.tensors(), dtype)
    aux = list(cfg.aux_layer_ids)
    config = {
        **_layer_config(cfg),
        "architectures": [NATIVE_ARCHITECTURE],
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": aux,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
        "torch_dtype": dtype_name(tensors["fc.weight"]),
        PROVENANCE_KEY: _provenance(cfg, target_identity),
    }
    return write_export_dir(out_dir, config, tensors)


def export_speculators(
    drafter: Eagle3Model,
    target_config: Any,
    out_dir: str | os.PathLike,
    *,
    verifier_name_or_path: str,
    speculative_tokens: int = 3,
    target_identity: Mapping[str, Any] | None = None,
    target_embed_weight: Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the speculators-format directory (speculators_model_type "eagle3", tensors `layers.0.*`).

    Self-contained: `embed_tokens.weight` is the target's embedding (checked equal to
    `target_embed_weight` when given). `norm_before_residual: false` is written explicitly: vLLM's
    speculators loader defaults it to true.
    """
    if speculative_tokens < 1:
        raise ExportError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
    check_export_invariants(drafter, target_config, target_embed_weight)
    target = hf_config_dict(target_config)
    cfg = drafter.config
    tensors = {
        name.replace("midlayer.", "layers.0.", 1): t
        for name, t in cast_weights(drafter.tensors(), dtype).items()
    }
    embed = drafter.embed_tokens.weight.detach().contiguous()
    tensors[EMBED_KEY] = embed.to(dtype) if dtype is not None else embed
    config = {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier_name_or_path,
                "architectures": list(target.get("architectures") or []),
            },
        },
        "transformer_layer_config": _layer_config(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "torch_dtype": dtype_name(tensors["fc.weight"]),
        PROVENANCE_KEY: _provenance(cfg, target_identity),
    }
    return write_export_dir(out_dir, config, tensors)


def _aux_ids(config: dict[str, Any], speculators: bool, source: str) -> list[int]:
    top = config.get("eagle_aux_hidden_state_layer_ids")
    if speculators:
        ids = top
    else:
        nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if top is not None and nested is not None and list(top) != list(nested):
            raise ExportError(
                f"{source}: aux layer ids differ between the top level {top} and eagle_config {nested}"
            )
        ids = top if top is not None else nested
    if not ids:
        raise ExportError(
            f"{source}: eagle_aux_hidden_state_layer_ids is missing; vLLM would silently pick its default layers"
        )
    return [int(i) for i in ids]


def _format_and_layer(config: dict, source: str) -> tuple[bool, dict]:
    """(whether the export is in speculators format, the dict holding its layer's sizes), after
    checking the fields that tell the two formats apart."""
    speculators = "speculators_model_type" in config
    if speculators:
        if config["speculators_model_type"] != "eagle3":
            raise ExportError(
                f"{source}: speculators_model_type is {config['speculators_model_type']!r}, not 'eagle3'"
            )
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ExportError(f"{source}: transformer_layer_config is missing")
        if "norm_before_residual" not in config:
            raise ExportError(
                f"{source}: norm_before_residual is missing; vLLM's speculators loader would assume true"
            )
    else:
        if NATIVE_ARCHITECTURE not in (config.get("architectures") or []):
            raise ExportError(
                f"{source}: architectures {config.get('architectures')} is neither native EAGLE-3 nor speculators"
            )
        layer = config
    return speculators, layer


def read_eagle3_export(
    export_dir: str | os.PathLike, embed_weight: Tensor | None = None
) -> tuple[Eagle3Config, Tensor, dict[str, Tensor]]:
    """Read a native or speculators EAGLE-3 export: its config, the embedding it runs on and its
    checkpoint tensors (`Eagle3Drafter.read_export` builds the drafter from them).

    A speculators export runs on the embedding it carries (as a loader that does not copy the
    verifier's would); `embed_weight`, when given, must equal it. A native export has none and
    runs on `embed_weight`, the target's. Refuses a corrupted export (missing d2t/t2d, missing,
    out-of-range or unordered aux ids, norm_before_residual true, a missing or foreign
    embed_tokens); `from_tensors` then refuses an inconsistent t2d and a wrong tensor set or
    shapes.
    """
    export_dir = Path(export_dir)
    source = str(export_dir)
    config_path, weights_path = export_dir / CONFIG_FILE, export_dir / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise ExportError(f"{path} not found: not an EAGLE-3 export directory")
    config = json.loads(config_path.read_text())
    speculators, layer = _format_and_layer(config, source)
    if config.get("norm_before_residual", False):
        raise ExportError(
            f"{source}: norm_before_residual is true; this drafter computes the residual before hidden_norm"
        )
    num_layers = (config.get(PROVENANCE_KEY) or {}).get("target_num_hidden_layers")
    if num_layers is None:
        raise ExportError(
            f"{source}: {PROVENANCE_KEY}.target_num_hidden_layers is missing; aux ids cannot be range-checked"
        )
    aux = _aux_ids(config, speculators, source)
    try:
        check_aux_layer_ids(aux, num_layers)
    except ValueError as err:
        raise ExportError(f"{source}: {err}") from None
    try:
        drafter_config = Eagle3Config(
            hidden_size=layer["hidden_size"],
            target_hidden_size=config.get("target_hidden_size") or layer["hidden_size"],
            intermediate_size=layer["intermediate_size"],
            num_attention_heads=layer["num_attention_heads"],
            num_key_value_heads=layer["num_key_value_heads"],
            head_dim=layer["head_dim"],
            rms_norm_eps=layer["rms_norm_eps"],
            rope_parameters=rope_parameters_of(layer),
            max_position_embeddings=layer["max_position_embeddings"],
            vocab_size=layer["vocab_size"],
            draft_vocab_size=config["draft_vocab_size"],
            aux_layer_ids=tuple(aux),
            target_num_layers=num_layers,
            hidden_act=layer.get("hidden_act", "silu"),
        )
    except KeyError as err:
        raise ExportError(f"{source}: config key {err} is missing") from None
    shape = (drafter_config.vocab_size, drafter_config.hidden_size)
    if embed_weight is not None and tuple(embed_weight.shape) != shape:
        raise ExportError(
            f"{source}: exported for a target with vocab {drafter_config.vocab_size} and hidden size "
            f"{drafter_config.hidden_size}, but the given embedding is {tuple(embed_weight.shape)}"
        )
    tensors = load_file(str(weights_path))
    if speculators:
        tensors = {name.replace("layers.0.", "midlayer.", 1): t for name, t in tensors.items()}
    embed = tensors.pop(EMBED_KEY, None)
    if embed is not None and embed_weight is not None:
        if not torch.equal(embed.to(embed_weight.dtype), embed_weight.detach().cpu()):
            raise ExportError(
                f"{source}: holds an embed_tokens that is not the target's; vLLM would serve with it"
            )
    if speculators:
        if embed is None:
            raise ExportError(
                f"{source}: {EMBED_KEY} is missing; a speculators export must carry the target's "
                "embedding (re-export it)"
            )
        if tuple(embed.shape) != shape:
            raise ExportError(f"{source}: {EMBED_KEY} is {tuple(embed.shape)}, expected {shape}")
        embed_weight = embed
    elif embed_weight is None:
        raise ExportError(
            f"{source}: a native EAGLE-3 export has no embedding; pass the target's embedding"
        )
    return drafter_config, embed_weight, tensors
