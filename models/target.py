"""The frozen target model: the only module that touches transformers model classes.

`Target` wraps a Hugging Face causal LM (Llama, Qwen2, Qwen3, Mistral) and exposes what the
pipeline needs from it, and nothing else: one forward that returns fp32 logits, the hidden states
at its aux layers (as many as the drafter kind reads: `models.kind.Reads`; EAGLE-3's three by
default) and the last (post-norm) hidden state; the frozen LM head; KV-cache
handling; and `score_tree`, which scores many short branches hanging off one context in a single
forward with a tree attention mask.

Attention masks are boolean `[B, T, S]` (True = may attend), where S counts the cached keys plus
the T new ones. They reach the model as a ready 4D mask, which transformers' `create_causal_mask`
passes through unchanged (`masking_utils._preprocess_mask_arguments`).

Layer ids follow the HF `hidden_states[k]` convention: the state entering decoder layer k.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from models.losses import renormalised_teacher
from models.teacher import TeacherLogits, draft_logits, teacher_logits
from models.vocab import DraftVocab

if TYPE_CHECKING:
    from transformers import DynamicCache


def default_aux_layer_ids(num_layers: int, count: int = 3) -> tuple[int, ...]:
    """Default feature layers, HF `hidden_states[k]` convention (state entering layer k): for
    three, EAGLE-3's and vLLM's (2, N//2, N-3); for another count, spread evenly from the output
    of layer 1 to that of layer N-3, where the public DFlash recipe places its context layers.
    A target too shallow for those (they would repeat or leave the range: (2, 2, 1) for 4
    layers) gets `count` ids spread evenly over all of [1, N), when it has that many."""
    if count == 3:
        ids: tuple[int, ...] = (2, num_layers // 2, num_layers - 3)
    elif count == 1:
        ids = (num_layers // 2 + 1,)
    else:
        span = num_layers - 4  # from layer 1's output to layer N-3's, both 0-based
        ids = tuple(2 + round(j * span / (count - 1)) for j in range(count))
    fits = (
        ids[0] >= 1
        and ids[-1] < num_layers
        and all(b > a for a, b in zip(ids, ids[1:], strict=False))
    )
    if fits or count > num_layers - 1:
        return ids
    if count == 1:
        return (num_layers // 2,)
    return tuple(1 + round(j * (num_layers - 2) / (count - 1)) for j in range(count))


def check_aux_layer_ids(
    aux_layer_ids: Sequence[int] | None, num_layers: int, count: int = 3
) -> None:
    """Raise unless there are `count` (as many as the drafter kind reads) strictly increasing
    ids in [1, num_layers).

    vLLM collects aux states in ascending layer order, once per layer, and id 0 (the embedding
    output) has no residual to add there: out-of-order or repeated ids load but accept nothing.
    """
    if count > num_layers - 1:
        raise ValueError(
            f"the drafter reads {count} target layers, but a {num_layers}-layer target has "
            f"{num_layers - 1} to read (ids in [1, {num_layers})): read fewer or use a deeper target"
        )
    if aux_layer_ids is None or len(aux_layer_ids) != count:
        raise ValueError(
            f"the drafter reads {count} target layers, so it needs exactly {count} aux layer ids, got "
            f"{aux_layer_ids!r}; the default for a {num_layers}-layer target is "
            f"{list(default_aux_layer_ids(num_layers, count))}"
        )
    check_aux_layer_order(aux_layer_ids)
    if int(aux_layer_ids[-1]) >= num_layers:
        raise ValueError(
            f"aux layer ids {list(aux_layer_ids)} out of range for a {num_layers}-layer target: ids use the "
            f"HF hidden_states[k] convention (state entering layer k), so each must be in [1, {num_layers})"
        )


def check_aux_layer_order(aux_layer_ids: Sequence[int]) -> None:
    """Raise unless the ids are strictly increasing and >= 1 (the part checkable without the target)."""
    ids = [int(i) for i in aux_layer_ids]
    if ids[0] < 1 or any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
        raise ValueError(
            f"aux layer ids {ids} must be strictly increasing and >= 1 (vLLM collects the states "
            "in ascending layer order, once per layer, and id 0 is the embedding output); "
            "e.g. [1, 3, 5] for a 6-layer target"
        )


# Architectures whose logits are exactly `lm_head(norm(h))` with a plain linear head, so that
# `logits_from_hidden` reproduces the model's own logits (no soft-capping or logit scaling).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Attention backends that accept a custom 4D mask: sdpa takes it as bool, eager as an additive bias.
SUPPORTED_ATTENTION = ("sdpa", "eager")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
RECORDED_SUMS_FILE = "opd_target.json"
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
SETTINGS_FILES = (
    "config.json",
    "generation_config.json",
    *TOKENIZER_FILES,
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    *TEMPLATE_FILES,
)
"""Files beside the weights that change what a target computes or how prompts reach it: its
architecture and rope, its generation settings, its tokenizer and its chat template
(`settings_sha256`)."""
EXTRA_TEMPLATES = "additional_chat_templates"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_HASH_CHUNK = 8 << 20


@dataclass
class TargetOutput:
    """One target forward. All tensors share the input's leading [B, T]."""

    logits: Tensor  # [B, T, V] fp32
    aux_hidden: Tensor  # [B, T, n*H]: hidden_states[k] for k in aux_layer_ids, concatenated
    last_hidden: Tensor  # [B, T, H]: after the final norm


@dataclass
class TreeScores:
    """Target scores for branches hanging off one context (see `Target.score_tree`).

    For a branch (a, tokens[L]), row j of `hidden` / `log_probs` is the target's state that predicts
    branch token j: row 0 comes from context position a-1, row j >= 1 from branch token j-1, and
    row L predicts the token that would follow the branch.

    The context's features equal a plain forward over it; its logits are not computed (for a large
    vocab they would dwarf everything else): `logits_from_hidden(context_last_hidden)` gives them.
    """

    context_aux_hidden: Tensor  # [T0, n*H]
    context_last_hidden: Tensor  # [T0, H]
    hidden: list[Tensor]  # per branch [L+1, H] post-norm last hidden
    log_probs: list[Tensor]  # per branch [L+1, V] fp32 log_softmax(logits / temperature)
    token_log_probs: list[Tensor]  # per branch [L]: log-prob of each branch token


class Target:
    """A frozen HF causal LM with the views the pipeline needs (see module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        aux_layer_ids: Sequence[int] | None = None,
        aux_layers: int = 3,
        identity: dict[str, Any],
    ) -> None:
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"target model_type {config.model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (their logits are a plain linear head over the "
                "final norm, which feature caching and teacher recomputation rely on)"
            )
        attn = config._attn_implementation
        if attn not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"target attention implementation {attn!r} cannot take tree/batch masks; load the "
                f"model with attn_implementation one of {SUPPORTED_ATTENTION}"
            )
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.config = config
        self.num_layers: int = config.num_hidden_layers
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size
        self.aux_layer_ids: tuple[int, ...] = _check_aux_layer_ids(
            aux_layer_ids, self.num_layers, aux_layers
        )
        self._decoder = model.get_decoder()
        self._layers = self._decoder.layers
        self.embed_weight: Tensor = model.get_input_embeddings().weight
        self.lm_head_weight: Tensor = model.get_output_embeddings().weight  # [V, H]
        if model.get_output_embeddings().bias is not None:
            raise ValueError("target lm_head has a bias; only bias-free heads are supported")
        self._window = _attention_window(config)
        self.identity = {
            **identity,
            "architecture": (config.architectures or [type(model).__name__])[0],
            "model_type": config.model_type,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_layers": self.num_layers,
            "aux_layer_ids": list(self.aux_layer_ids),
        }

    @classmethod
    def from_model(
        cls, hf_model: nn.Module, aux_layer_ids: Sequence[int] | None = None, aux_layers: int = 3
    ) -> Target:
        """Wrap an in-process HF model (tests, notebooks); identity hashes its parameters."""
        return cls(
            hf_model,
            aux_layer_ids=aux_layer_ids,
            aux_layers=aux_layers,
            identity=_state_identity(hf_model),
        )

    @property
    def device(self) -> torch.device:
        return self.lm_head_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head_weight.dtype

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from the generation config (falling back to the model config)."""
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.config, "eos_token_id", None)
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    # ------------------------------------------------------------------ forward

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,
        *,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: DynamicCache | None = None,
    ) -> TargetOutput:
        """Run the target on `input_ids` [B, T], appending to `cache` when given.

        `attention_mask` is bool [B, T, S] (True = may attend), S = cached keys + T; None means
        plain causal over cache + new tokens, with positions continuing from the cache length.
        """
        aux, last = self.forward_features(
            input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache
        )
        return TargetOutput(logits=self.logits_from_hidden(last), aux_hidden=aux, last_hidden=last)

    __call__ = forward

    @torch.no_grad()
    def forward_features(
        self,
        input_ids: Tensor,
        *,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: DynamicCache | None = None,
    ) -> tuple[Tensor, Tensor]:
        """`forward` without the LM head: (aux_hidden [B, T, n*H], last_hidden [B, T, H]).

        For feature extraction, where [B, T, V] logits would cost memory and time for nothing.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        batch, length = input_ids.shape
        past = self.cache_length(cache)
        if position_ids is not None and position_ids.shape != input_ids.shape:
            raise ValueError(
                f"position_ids shape {tuple(position_ids.shape)} must equal input_ids shape "
                f"{tuple(input_ids.shape)}"
            )
        if attention_mask is not None and attention_mask.shape != (batch, length, past + length):
            raise ValueError(
                f"attention_mask must be bool [B, T, cache+T] = {(batch, length, past + length)}, "
                f"got {tuple(attention_mask.shape)}"
            )
        if self._window is not None and past + length > self._window:
            raise ValueError(
                f"{past + length} keys exceed the target's sliding window of {self._window}; "
                "sliding-window attention is not supported past the window"
            )
        input_ids = input_ids.to(self.device)  # as the mask: callers may hand host tensors
        if position_ids is not None:
            position_ids = position_ids.to(self.device)
        captured: dict[int, Tensor] = {}
        hooks = [
            self._layers[k].register_forward_pre_hook(_capture_input(captured, k), with_kwargs=True)
            for k in set(self.aux_layer_ids)
        ]
        try:
            out = self._decoder(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=None if attention_mask is None else self._mask_4d(attention_mask),
                past_key_values=cache,
                use_cache=cache is not None,
            )
        finally:
            for hook in hooks:
                hook.remove()
        aux = torch.cat([captured[k] for k in self.aux_layer_ids], dim=-1)  # [B, T, n*H]
        return aux, out.last_hidden_state  # [B, T, H] after the final norm

    @torch.no_grad()
    def logits_from_hidden(self, last_hidden: Tensor) -> Tensor:
        """The frozen LM head: post-norm hidden [..., H] -> fp32 logits [..., V]."""
        weight = self.lm_head_weight
        return F.linear(last_hidden.to(device=weight.device, dtype=weight.dtype), weight).float()

    @torch.no_grad()
    def draft_teacher(self, last_hidden: Tensor, vocab: DraftVocab, temperature: float) -> Tensor:
        """The renormalised training teacher [..., Vd] at post-norm hidden [..., H], from the
        head's draft-id rows alone: for losses that read nothing else of the target's logits."""
        return renormalised_teacher(
            draft_logits(last_hidden, self.lm_head_weight, vocab.draft_to_target_ids), temperature
        )

    @torch.no_grad()
    def teacher(
        self, last_hidden: Tensor, vocab: DraftVocab, temperatures: Sequence[float] = ()
    ) -> TeacherLogits:
        """The training teacher at post-norm hidden [..., H], in vocabulary blocks of bounded
        size (`models.teacher`): what `logits_from_hidden` gives, without the [..., V] logits."""
        return teacher_logits(
            last_hidden, self.lm_head_weight, vocab.draft_to_target_ids, temperatures
        )

    def _mask_4d(self, mask: Tensor) -> Tensor:
        if mask.dtype != torch.bool:
            raise ValueError(
                f"attention_mask must be torch.bool (True = may attend), got {mask.dtype}"
            )
        mask = mask.to(self.device)[:, None]  # [B, 1, T, S]
        if self.config._attn_implementation == "sdpa":
            return mask
        # eager adds the mask to the attention scores, so it needs an additive bias
        bias = torch.zeros(mask.shape, dtype=self.dtype, device=self.device)
        return bias.masked_fill_(~mask, torch.finfo(self.dtype).min)

    # ------------------------------------------------------------------ KV cache

    def new_cache(self) -> DynamicCache:
        """An empty KV cache; every layer keeps all keys (masks decide what is visible)."""
        from transformers import DynamicCache

        return DynamicCache()

    @staticmethod
    def cache_length(cache: DynamicCache | None) -> int:
        return 0 if cache is None else cache.get_seq_length()

    @staticmethod
    def crop_cache(cache: DynamicCache, length: int) -> None:
        """Drop every cache slot at index >= `length` (in place)."""
        current = cache.get_seq_length()
        if not 0 <= length <= current:
            raise ValueError(f"cannot crop a cache of {current} slots to {length}")
        if length < current:
            cache.crop(length - current)

    @staticmethod
    def keep_cache_slots(cache: DynamicCache, start: int, index: Tensor) -> None:
        """Replace the slots from `start` on by the per-row slots `start + index` [B, W] (in place).

        A tree verify step appends every node's keys; only the root and the accepted path are
        ever read again, and packing them keeps the cache growing by the emitted tokens, not by
        the tree budget.
        """
        for layer in cache.layers:
            heads, dim = layer.keys.shape[1], layer.keys.shape[3]
            at = index[:, None, :, None].expand(-1, heads, -1, dim)  # [B, kv, W, d]
            layer.keys = torch.cat(
                [layer.keys[:, :, :start], layer.keys[:, :, start:].gather(2, at)], 2
            )
            layer.values = torch.cat(
                [layer.values[:, :, :start], layer.values[:, :, start:].gather(2, at)], 2
            )

    @staticmethod
    def select_cache_rows(cache: DynamicCache, rows: Tensor) -> None:
        """Keep only batch rows `rows` (in place), e.g. to drop finished sequences."""
        cache.batch_select_indices(rows)

    # ------------------------------------------------------------------ tree scoring

    @torch.no_grad()
    def score_tree(
        self,
        context_ids: Tensor | Sequence[int],
        branches: Sequence[tuple[int, Tensor | Sequence[int]]],
        *,
        temperature: float = 1.0,
    ) -> TreeScores:
        """Score branches (anchor a, tokens[L]) off one context in ONE forward.

        A branch replaces the context from position a on: its token j sits at position a + j and
        sees context[:a] plus its own earlier tokens, exactly as if `context[:a] + tokens` were run
        alone. Cost: the context once plus sum(L) branch tokens, instead of one full-prefix pass per
        branch. The context part of the result equals a plain forward over the context.
        """
        # the positions and the mask are built on the CPU and moved once
        context = torch.as_tensor(context_ids, dtype=torch.long).reshape(-1).cpu()
        num_ctx = context.numel()
        if num_ctx == 0:
            raise ValueError("score_tree needs a non-empty context")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
        parsed = []
        for i, (anchor, tokens) in enumerate(branches):
            tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).cpu()
            if not 1 <= anchor <= num_ctx:
                raise ValueError(
                    f"branch {i}: anchor {anchor} must be in [1, {num_ctx}] (the branch needs at "
                    "least one context token before it and cannot start past the context's end)"
                )
            if tokens.numel() == 0:
                raise ValueError(f"branch {i} has no tokens")
            parsed.append((int(anchor), tokens))
        all_ids = torch.cat([context] + [t for _, t in parsed])
        if int(all_ids.min()) < 0 or int(all_ids.max()) >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), the target's vocab")

        total = all_ids.numel()
        positions = torch.empty(total, dtype=torch.long)
        positions[:num_ctx] = torch.arange(num_ctx)
        mask = torch.zeros(total, total, dtype=torch.bool)  # [N, N]
        mask[:num_ctx, :num_ctx] = torch.ones(num_ctx, num_ctx, dtype=torch.bool).tril_()
        spans = []
        start = num_ctx
        for anchor, tokens in parsed:
            end = start + tokens.numel()
            positions[start:end] = torch.arange(anchor, anchor + tokens.numel())
            mask[start:end, :anchor] = True
            mask[start:end, start:end] = torch.ones(
                end - start, end - start, dtype=torch.bool
            ).tril_()
            spans.append((start, end))
            start = end

        aux, last = self.forward_features(
            all_ids[None].to(self.device),
            position_ids=positions[None].to(self.device),
            attention_mask=mask[None],
        )
        last = last[0]  # [N, H]
        # only the rows a branch reads go through the LM head: the context's would be T0 x V
        rows = [
            torch.cat([torch.tensor([anchor - 1]), torch.arange(start, end)])
            for (anchor, _), (start, end) in zip(parsed, spans, strict=True)
        ]
        picked = torch.cat(rows).to(self.device)
        scored = torch.log_softmax(self.logits_from_hidden(last[picked]) / temperature, dim=-1)
        hidden = list(last[picked].split([len(r) for r in rows]))  # per branch [L+1, H]
        log_probs = list(scored.split([len(r) for r in rows]))  # per branch [L+1, V]
        token_log_probs = [
            lp[:-1].gather(-1, tokens[:, None].to(self.device))[:, 0]
            for lp, (_, tokens) in zip(log_probs, parsed, strict=True)
        ]
        return TreeScores(aux[0, :num_ctx], last[:num_ctx], hidden, log_probs, token_log_probs)


def load_target(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    device_map: str | None = None,
    aux_layer_ids: Sequence[int] | None = None,
    aux_layers: int = 3,
) -> Target:
    """Load a local HF causal-LM directory (safetensors weights) as a frozen `Target`.

    Checks, before loading any weights: the directory holds an HF config and safetensors weights
    (`model.safetensors`, or the shards its index lists; never a pickle), every weights file has
    a readable header, the tensors' shapes fit config.json, its tokenizer (if any) fits the
    model's vocab, and the aux layer ids are valid (`aux_layers` of them: as many as the
    drafter kind reads). The identity hashes exactly the files loaded.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"target path {path} does not exist or is not a directory")
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{path} is not a Hugging Face model directory: no config.json (point the target path "
            "at the directory that holds config.json and the *.safetensors weights)"
        )
    weight_files = _weight_files(path)
    _check_recorded_sha256(path, weight_files)
    shapes = _safetensors_shapes(weight_files)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{path}: model_type {getattr(config, 'model_type', None)!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    _check_aux_layer_ids(aux_layer_ids, config.num_hidden_layers, aux_layers)
    _check_shapes(path, config, shapes)
    if any((path / name).is_file() for name in TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if len(tokenizer) > config.vocab_size:
            raise ValueError(
                f"{path}: the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                f"{config.vocab_size}; ids past the embedding would crash or be silently wrong. "
                "Use the tokenizer the model was trained with."
            )
    try:
        with _transformers_bars_hidden():
            model = AutoModelForCausalLM.from_pretrained(
                path,
                local_files_only=True,
                dtype=dtype,
                device_map=device_map,
                use_safetensors=True,
            )
        if device_map is None:  # with a device map, accelerate has placed every layer already
            model = model.to(device)
    except (OSError, RuntimeError, SafetensorError) as err:
        raise ValueError(f"{path}: the weights do not load ({_one_line(err)})") from None
    identity = {"path": str(path.resolve()), "weights_sha256": _files_sha256(weight_files)}
    return Target(model, aux_layer_ids=aux_layer_ids, aux_layers=aux_layers, identity=identity)


@contextmanager
def _transformers_bars_hidden() -> Iterator[None]:
    """transformers' own progress bars (its "Loading weights" bar, drawn at every load, a cached
    stage's included) hidden, unless `opd --verbose` (OPD_VERBOSE) shows the libraries' output:
    a stage prints its own lines and bars (plain tqdm, which this leaves alone)."""
    from transformers.utils import logging as hf_logging

    from models.vllm_engine import verbose

    if verbose() or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:  # as the process had it: a host process's own loads keep their bars
        hf_logging.enable_progress_bar()


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 300 else text[:300] + "..."


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files transformers loads from `path` with use_safetensors=True."""
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(
                f"{index} is not a safetensors index ({_one_line(err)}); restore it from the checkpoint"
            ) from None
        files = [path / name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(
                f"{path}: weight shards {missing} listed in {SAFETENSORS_INDEX} are missing; "
                "copy the complete checkpoint"
            )
        return files
    if (path / SAFETENSORS_FILE).is_file():
        return [path / SAFETENSORS_FILE]
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(
            f"{path}: the weights are pickles only ({', '.join(pickles)}), which are never loaded; "
            f"convert the checkpoint to safetensors ({SAFETENSORS_FILE}, e.g. save_pretrained in "
            "an environment you trust)"
        )
    raise ValueError(
        f"{path} has no safetensors weights ({SAFETENSORS_FILE} or {SAFETENSORS_INDEX}); "
        "convert the checkpoint to safetensors (pickled .bin checkpoints are never loaded)"
    )


def _safetensors_shapes(files: Sequence[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Tensor name -> (file, shape) from the headers; a corrupted or truncated file is named."""
    shapes: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    shapes[name] = (file, tuple(handle.get_slice(name).get_shape()))
        except (SafetensorError, OSError) as err:
            raise ValueError(
                f"{file} is not a readable safetensors file ({_one_line(err)}): it is truncated or "
                "corrupted; copy or convert it again"
            ) from None
    return shapes


def _check_shapes(path: Path, config: Any, shapes: dict[str, tuple[Path, tuple[int, ...]]]) -> None:
    """Refuse weights whose shapes contradict config.json (transformers would re-initialise them)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    for name, (file, shape) in shapes.items():
        if name in expected and shape != expected[name]:
            raise ValueError(
                f"{path}: tensor {name} in {file.name} is {list(shape)} but config.json "
                f"(hidden_size {config.hidden_size}, {config.num_hidden_layers} layers) needs "
                f"{list(expected[name])}; config.json does not belong to these weights: restore "
                "the checkpoint's own config.json"
            )


def _check_aux_layer_ids(ids: Sequence[int] | None, num_layers: int, count: int) -> tuple[int, ...]:
    if ids is None:
        ids = default_aux_layer_ids(num_layers, count)
        try:
            check_aux_layer_ids(ids, num_layers, count)
        except ValueError as err:
            raise ValueError(
                f"the default aux layer ids {list(ids)} do not fit a {num_layers}-layer target "
                f"({err}); pass aux_layer_ids explicitly"
            ) from None
        return ids
    ids = tuple(ids)
    if len(ids) != count or not all(isinstance(k, int) and not isinstance(k, bool) for k in ids):
        raise ValueError(
            f"aux_layer_ids must be {count} integers (strictly increasing: as many as the "
            f"drafter kind reads), got {ids!r}"
        )
    check_aux_layer_ids(ids, num_layers, count)
    return ids


def _capture_input(store: dict[int, Tensor], layer: int):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        store[layer] = args[0] if args else kwargs["hidden_states"]

    return hook


def _attention_window(config: Any) -> int | None:
    """The sliding window if any layer uses one (our tree/batch masks are full attention)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None:
        return None
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


def _check_recorded_sha256(path: Path, weight_files: Sequence[Path]) -> None:
    """Weights whose sha256 the directory records (`opd_target.json`, written by the embedded
    target's trainer) must match it: a flipped byte still loads, as another model."""
    meta = path / RECORDED_SUMS_FILE
    if not meta.is_file():
        return
    try:
        record = json.loads(meta.read_text())
        recorded = record.get("weights_sha256") or {}
    except (OSError, ValueError, AttributeError) as err:
        raise ValueError(f"{meta} is unreadable ({_one_line(err)}); restore it") from None
    # how to restore it: the record says (a converted target), or git (the embedded one)
    how = record.get("restore") if isinstance(record.get("restore"), str) else None
    if how is None and "corpus" in record:  # the embedded target's trainer's record
        how = "the embedded target is in git: git checkout -- models/tiny_target/model"
    for file in weight_files:
        if file.name in recorded and _files_sha256([file], named=False) != recorded[file.name]:
            raise ValueError(
                f"{file}: its sha256 differs from the one recorded in {meta.name}, so the file "
                f"is damaged; restore it from its source ({how or 'copy it again'})"
            )


def settings_sha256(directory: Path, names: Sequence[str] = SETTINGS_FILES) -> str:
    """sha256 over the `names` files `directory` holds (each file's name and bytes; absent ones
    count as absent) and its extra chat templates: with the weights' sha256, a target's
    identity, so an edited template, tokenizer or config makes new dataset versions."""
    directory = Path(directory)
    files = [directory / n for n in names if (directory / n).is_file()]
    if any(n in TEMPLATE_FILES for n in names) and (directory / EXTRA_TEMPLATES).is_dir():
        files += sorted((directory / EXTRA_TEMPLATES).glob("*.jinja"))
    return _files_sha256(files)


def _files_sha256(files: Sequence[Path], *, named: bool = True) -> str:
    digest = hashlib.sha256()
    for file in files:
        if named:
            digest.update(file.name.encode())
        with open(file, "rb") as handle:
            while chunk := handle.read(_HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def _state_identity(model: nn.Module) -> dict[str, Any]:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().cpu().contiguous()
        digest.update(json.dumps([name, str(data.dtype), list(data.shape)]).encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy())  # a view: no copy of a 2 GB head
    return {"path": None, "weights_sha256": digest.hexdigest()}
