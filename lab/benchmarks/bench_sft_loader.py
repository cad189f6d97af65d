"""SFT training throughput and the data loader's stall share, on realistic feature shards.

Writes feature shards shaped like the embedded target's through the store (hidden 256, so
aux_hidden is 768 bf16 values a token; sequences of 96-320 tokens, like its greedy
trajectories; vocab 4096, each draft vocab of `--draft-vocabs`), then runs the real `sft`
stage for `--steps` steps per draft vocab and precision and reports, side by side:

- stall_share: time the step waited for its next batch / total step time (goal <= 5%);
- sync_collate_share: what building the same batches on the training thread would cost,
  as a share of the step time (what the background thread hides);
- tokens_per_s with bf16 autocast and (with --fp32) without, and the ratios between them
  and between the draft vocab sizes.

    python -m lab.benchmarks.bench_sft_loader [--steps 30] [--rows 256] [--draft-vocabs 4096,1024] [--fp32]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import torch
from safetensors.torch import save as save_safetensors

from models.vocab import DraftVocab
from pipeline.core import featurize, training, validation
from pipeline.core.runner import RunContext, run_stage
from pipeline.core.targets import RandomTargetConfig, TargetConfig, TargetLoader
from pipeline.stages import features, sft
from storage import Store, tensor_array

EMBEDDED_SHAPE = RandomTargetConfig(
    num_layers=6, hidden_size=256, num_heads=4, num_kv_heads=4, intermediate_size=768
)


def write_features(
    store: Store, rows: int, hidden: int, vocab: int, draft_vocab: int, rows_per_shard: int = 64
):
    """Random bf16 features with realistic lengths; trained on, they only need the right shapes."""
    g = torch.Generator().manual_seed(0)
    schema = featurize.feature_schema(hidden)
    config = {"rows": rows, "draft_vocab": draft_vocab}
    with store.writer("features", stage="bench", stage_version="1", config=config) as w:
        counts = torch.randint(1, 1000, (vocab,), generator=g)
        v = DraftVocab.from_counts(counts, draft_vocab)
        w.write_bytes(
            features.VOCAB_FILE, save_safetensors({"d2t": v.d2t, "t2d": v.t2d, "counts": counts})
        )
        for s in range(0, rows, rows_per_shard):
            n = min(rows_per_shard, rows - s)
            lengths = torch.randint(96, 321, (n,), generator=g).tolist()
            prompt = [int(torch.randint(16, 64, (1,), generator=g)) for _ in lengths]
            table = pa.table(
                [
                    pa.array([f"seq-{s + i}" for i in range(n)]),
                    pa.array(
                        [torch.randint(0, vocab, (t,), generator=g).tolist() for t in lengths],
                        pa.list_(pa.int32()),
                    ),
                    pa.array(
                        [[0] * p + [1] * (t - p) for t, p in zip(lengths, prompt, strict=True)],
                        pa.list_(pa.int8()),
                    ),
                    tensor_array(
                        [torch.randn(t, 3 * hidden, generator=g).bfloat16() for t in lengths],
                        schema.field("aux_hidden"),
                    ),
                    tensor_array(
                        [torch.randn(t, hidden, generator=g).bfloat16() for t in lengths],
                        schema.field("last_hidden"),
                    ),
                ],
                schema=schema,
            )
            w.write_ipc(f"part-{s // rows_per_shard:05d}.arrow", table)
        return w.commit()


def sync_collate_seconds(feats, cfg: sft.Config, steps: int) -> float:
    """Seconds to build `steps` batches of the same plan on the calling thread."""
    index = training.FeatureIndex(feats, validation.FEATURE_COLUMNS)
    loader = training.FeatureLoader(
        index, range(len(index)), batch_size=cfg.batch_size, max_tokens=cfg.max_tokens
    )
    plan = [rows for e in range(steps // len(loader) + 1) for rows in loader.plan(e)][:steps]
    t0 = time.perf_counter()
    for rows in plan:
        index.collate(rows)
    return time.perf_counter() - t0


def measure(
    *,
    steps: int,
    rows: int,
    batch_size: int,
    max_tokens: int,
    draft_vocabs: list[int],
    threads: int | None = None,
    fp32: bool = False,
    directory: Path | None = None,
    device: str = "auto",
) -> dict:
    tmp = Path(directory or tempfile.mkdtemp(prefix="opd-bench-sft-"))
    try:
        store = Store(tmp)
        loader = TargetLoader(
            TargetConfig(
                path="random", random=EMBEDDED_SHAPE, aux_layer_ids=[1, 3, 5], device=device
            )
        )
        target = loader.target
        ctx = RunContext(store=store, target_loader=loader, progress=False)
        results = {}
        for vd in draft_vocabs:
            feats = write_features(store, rows, target.hidden_size, target.vocab_size, vd)
            for bf16 in [True, False] if fp32 else [True]:
                cfg = sft.Config(
                    steps=steps,
                    batch_size=batch_size,
                    max_tokens=max_tokens,
                    val_share=0.0,
                    bf16=bf16,
                    threads=threads,
                )
                meta = run_stage(sft.STAGE, cfg, {"features": feats}, ctx, force=True).dataset.meta
                sync = sync_collate_seconds(feats, cfg, steps)
                results[f"{'bf16' if bf16 else 'fp32'}_vd{vd}"] = {
                    "tokens_per_s": meta["tokens_per_s_this_run"],
                    "stall_share": meta["loader_stall_share"],
                    "sync_collate_share": round(sync / meta["seconds_this_run"], 4),
                    "seconds": meta["seconds_this_run"],
                }
    finally:
        if directory is None:
            shutil.rmtree(tmp, ignore_errors=True)
    out = {
        "device": str(target.device),
        "steps": steps,
        "rows": rows,
        "batch_size": batch_size,
        "max_tokens": max_tokens,
        "threads": torch.get_num_threads(),
        "hidden": target.hidden_size,
        "vocab": target.vocab_size,
        **results,
    }
    speed = {k: v["tokens_per_s"] for k, v in results.items()}
    for vd in draft_vocabs:
        if f"fp32_vd{vd}" in speed:
            out[f"bf16_over_fp32_vd{vd}"] = round(speed[f"bf16_vd{vd}"] / speed[f"fp32_vd{vd}"], 3)
    if len(draft_vocabs) > 1:
        big, small = max(draft_vocabs), min(draft_vocabs)
        out[f"bf16_vd{small}_over_vd{big}"] = round(
            speed[f"bf16_vd{small}"] / speed[f"bf16_vd{big}"], 3
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument(
        "--draft-vocabs", default="4096", help="comma-separated draft vocab sizes to compare"
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--fp32", action="store_true", help="also time fp32 (no autocast)")
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    out = measure(
        steps=args.steps,
        rows=args.rows,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        draft_vocabs=[int(v) for v in args.draft_vocabs.split(",")],
        threads=args.threads,
        fp32=args.fp32,
        directory=args.dir,
        device=args.device,
    )
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
