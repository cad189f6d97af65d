"""Stage 1, `generate`: the target answers the prompts; its own token ids become trajectories.

Consumes `prompts` (rows of one split) and the target. Produces `trajectories` (Parquet, one
row per sequence): seq_id, prompt_id, input_ids (prompt + response, the engine's ids, never
re-tokenized), prompt_len, loss_mask (1 on response tokens), finish_reason (eos | length) and
the sampling params. Shards hold `rows_per_shard` prompts each, in prompt order; shard i is
written by rank i % world_size, and its sampling seed depends only on (seed, i), so any worker
layout and any resume produce the same bytes.

The engine is `generate.backend`: `hf` (transformers' batched `generate`) or `vllm` (the optional
extra, through models/vllm_engine.py, same prompts, sampling parameters, stop ids and per-shard
seeds; the engine's token ids are stored as they come). `auto` takes vLLM where it is installed
and can load the target, else HF: on 2 CPU cores vLLM generated 1.7-2.2x HF's trajectories/s
(lab/benchmarks/bench_generate.py). The engine used enters the version: at T=0 the two agree on most
prompts but not all, and they sample from different random streams.

With `source` set it generates nothing and reads no prompts: the trajectories are the rows of
a pre-generated file (an `opd data export` Parquet file of the target's token ids, or chat
JSONL rendered with its template; pipeline/core/trajectory_files.py). A file made with another
tokenizer or chat template is refused before any work; the file's name and sha256 are in the
version and its path, sha256 and what made it in the manifest's meta (`source`).

Resumes: completed shards are skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import pyarrow as pa
import torch
from pydantic import Field
from tqdm import tqdm

from models import vllm_engine
from pipeline.core import trajectory_files
from pipeline.core.config import StrictConfig, optional_field, runtime_field, version_dict
from pipeline.core.prompt_sets import select_prompts
from pipeline.core.runner import RunContext
from pipeline.core.stage import Inputs, Stage
from pipeline.core.targets import check_engine_target, resolve_backend, resolve_dtype
from storage import Dataset, DatasetWriter, OpdError, sha256_file

log = logging.getLogger("opd")

SCHEMA = trajectory_files.TRAJECTORY_SCHEMA


class Config(StrictConfig):
    split: Literal["train", "heldout"] = "train"
    max_prompts: int | None = Field(None, ge=1)
    """Use the first N prompts of the split (None = all)."""
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    """0 = greedy. EAGLE-3 trains on the target's own (greedy or sampled) responses."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    samples_per_prompt: int = Field(1, ge=1)
    seed: int = 0
    batch_size: int = Field(16, ge=1)
    rows_per_shard: int = Field(256, ge=1)
    backend: Literal["auto", "vllm", "hf"] = runtime_field(
        "auto", "generation engine; the one it resolves to enters the version (resolved_engine)"
    )
    source: str | None = optional_field(
        "a file of pre-generated conversations to take instead of generating: an `opd data "
        "export` Parquet file (the target's token ids, checked against its tokenizer and chat "
        "template) or chat JSONL (rendered with the target's template); no prompts are read "
        "and the settings above do not apply (pipeline/core/trajectory_files.py)"
    )


def resolved_engine(cfg: Config, ctx: RunContext) -> str | None:
    """`hf` or `vllm`: what `cfg.backend` means for this run's target on this machine (None:
    rows from a `source` file, no engine)."""
    if cfg.source is not None:
        return None
    return resolve_backend(cfg.backend, ctx.target_loader)


def version_config(cfg: Config) -> dict:
    """The config as the version records it: a source file by name (`version_extra` hashes
    its content), so the same file anywhere is one version."""
    out = version_dict(cfg)
    if cfg.source is not None:
        out["source"] = Path(cfg.source).name
    return out


def version_extra(cfg: Config) -> dict:
    """The source file's sha256: another file, or an edited one, is another version."""
    if cfg.source is None:
        return {}
    path = Path(cfg.source).expanduser()
    if not path.is_file():
        raise ValueError(f"generate.source {path} is not a file: pass a .parquet or .jsonl file")
    return {"source_sha256": sha256_file(path)}


def unread_inputs(cfg: Config) -> tuple[str, ...]:
    """With a source file, generate reads no prompts."""
    return ("prompts",) if cfg.source is not None else ()


def precheck(cfg: Config, inputs: Mapping[str, Dataset], ctx: RunContext) -> None:
    """A source file made for another tokenizer or template is refused before any work."""
    if cfg.source is not None:
        trajectory_files.check_source(Path(cfg.source).expanduser(), ctx.target_loader.tokenizer)


def _start_vllm(
    cfg: Config, ctx: RunContext, output: DatasetWriter
) -> tuple[vllm_engine.EngineSpec | None, bool]:
    """(the engine spec, whether this call started it) with the vLLM backend; (None, False) without.

    vLLM's own output goes to `vllm.log` in the stage's work directory (`opd --verbose`: stderr).
    """
    if resolved_engine(cfg, ctx) != "vllm":
        return None, False
    loader = ctx.target_loader
    check_engine_target("generate", cfg, loader.cfg)
    spec = vllm_engine.EngineSpec(str(loader.directory), resolve_dtype(loader.cfg))
    engine_log = output.store.root / "_work" / "generate" / output.version / "vllm.log"
    try:
        started = vllm_engine.start(spec, engine_log)
    except vllm_engine.VllmError as e:
        raise OpdError(f"generate.backend=vllm: {e}") from None
    if (shown := vllm_engine.log_path(spec)) is not None:
        log.info("[generate] vLLM's engine log: %s", shown)
    return spec, started


@torch.no_grad()
def generate_batch(
    model, pad_id: int, eos_ids: tuple[int, ...], prompts: list[list[int]], cfg: Config
):
    """Left-padded batched HF `generate` with a KV cache; returns (responses, finish reasons)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    sample = cfg.temperature > 0
    out = model.generate(
        input_ids=ids.to(model.device),
        attention_mask=mask.to(model.device),
        max_new_tokens=cfg.max_new_tokens,
        do_sample=sample,
        temperature=cfg.temperature if sample else None,
        top_p=cfg.top_p if sample else None,
        top_k=None,
        pad_token_id=pad_id,
        eos_token_id=list(eos_ids) or None,
        use_cache=True,
    )
    responses, reasons = [], []
    for row in out[:, width:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in eos_ids), None)
        responses.append(row[:cut] if cut else row)
        reasons.append("eos" if cut else "length")
    return responses, reasons


def from_source(
    cfg: Config, output: DatasetWriter, rank: int, world_size: int, ctx: RunContext
) -> dict:
    """The rows of `cfg.source` as they are (Parquet) or rendered (chat JSONL), in file order,
    `rows_per_shard` a shard."""
    path = Path(cfg.source).expanduser()
    loader = ctx.target_loader
    info = trajectory_files.check_source(path, loader.tokenizer)
    table = trajectory_files.read_rows(path, info, loader.tokenizer, loader.target.vocab_size)
    n_shards = (table.num_rows + cfg.rows_per_shard - 1) // cfg.rows_per_shard
    for i in range(rank, n_shards, world_size):
        shard = f"part-{i:05d}.parquet"
        if not output.has_shard(shard):
            output.write_parquet(shard, table.slice(i * cfg.rows_per_shard, cfg.rows_per_shard))
    about = {"file": path.name, "path": str(path.resolve()), "sha256": sha256_file(path)}
    log.info(
        "[generate] %d trajectories from %s (sha256 %s)", table.num_rows, path, about["sha256"]
    )
    meta = {
        "sequences": table.num_rows,
        "shards": n_shards,
        "source": about | {"format": info.kind},
    }
    if info.kind == "parquet":  # what made the rows, carried to the next export
        meta["generation"] = info.meta.get("generation")
        meta["source"]["made_from"] = info.meta.get("source")
    return meta


def run(
    cfg: Config, inputs: Inputs, output: DatasetWriter, rank: int, world_size: int, ctx: RunContext
) -> dict:
    if cfg.source is not None:
        return from_source(cfg, output, rank, world_size, ctx)
    prompts = select_prompts(inputs["prompts"], cfg.split, cfg.max_prompts)
    jobs = [(p, s) for p in prompts for s in range(cfg.samples_per_prompt)]
    target = ctx.target_loader.target
    tok = ctx.target_loader.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (target.eos_token_ids or (0,))[0]
    n_shards = (len(jobs) + cfg.rows_per_shard - 1) // cfg.rows_per_shard
    mine = [i for i in range(n_shards) if i % world_size == rank]
    bar = tqdm(
        total=sum(min(cfg.rows_per_shard, len(jobs) - i * cfg.rows_per_shard) for i in mine),
        desc="generate",
        unit="seq",
        disable=not ctx.progress,
    )
    spec, started = _start_vllm(cfg, ctx, output)
    for i in mine:
        shard = f"part-{i:05d}.parquet"
        chunk = jobs[i * cfg.rows_per_shard : (i + 1) * cfg.rows_per_shard]
        if output.has_shard(shard):
            bar.update(len(chunk))
            continue
        torch.manual_seed(cfg.seed * 1_000_003 + i)
        # Similar lengths per batch waste less padding; the order inside a shard is restored below.
        order = sorted(range(len(chunk)), key=lambda j: len(chunk[j][0]["prompt_ids"]))
        results: dict[int, tuple[list[int], str]] = {}
        if spec is not None:  # the whole shard at once: vLLM schedules its own batches
            out = vllm_engine.generate(
                spec,
                [chunk[j][0]["prompt_ids"] for j in order],
                max_new_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                seeds=[(cfg.seed * 1_000_003 + i) * cfg.rows_per_shard + j for j in order],
                stop_ids=target.eos_token_ids,
            )
            results = dict(zip(order, out, strict=True))
            bar.update(len(order))
        else:
            for b in range(0, len(order), cfg.batch_size):
                idx = order[b : b + cfg.batch_size]
                resp, why = generate_batch(
                    target.model,
                    pad_id,
                    target.eos_token_ids,
                    [chunk[j][0]["prompt_ids"] for j in idx],
                    cfg,
                )
                results.update({j: (r, w) for j, r, w in zip(idx, resp, why, strict=True)})
                bar.update(len(idx))
        rows = []
        for j, (p, s) in enumerate(chunk):
            resp, why = results[j]
            prompt_ids = list(p["prompt_ids"])
            rows.append(
                {
                    "seq_id": f"{p['prompt_id']}-{s}",
                    "prompt_id": p["prompt_id"],
                    "input_ids": prompt_ids + resp,
                    "prompt_len": len(prompt_ids),
                    "loss_mask": [0] * len(prompt_ids) + [1] * len(resp),
                    "finish_reason": why,
                    "temperature": cfg.temperature,
                    "top_p": cfg.top_p,
                    "seed": cfg.seed,
                }
            )
        output.write_parquet(shard, pa.Table.from_pylist(rows, schema=SCHEMA))
    if started:
        vllm_engine.close(spec)
    bar.close()
    return {"sequences": len(jobs), "shards": n_shards, "split": cfg.split}


STAGE = Stage(
    name="generate",
    output="trajectories",
    version="1",
    config=Config,
    run=run,
    doc="the target answers the prompts; its own token ids become trajectories",
    inputs={"prompts": ("prompts",)},
    sharded=True,
    engine=resolved_engine,
    precheck=precheck,
    version_config=version_config,
    version_extra=version_extra,
    unread_inputs=unread_inputs,
)
