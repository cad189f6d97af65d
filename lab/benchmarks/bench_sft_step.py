"""An SFT step's speed against this machine's matmul roof, with the draft head's loss fused or
unfused, in bf16 autocast or fp32, measured side by side in one run.

One step of `pipeline.stages.sft` is: the teacher, the drafter's unrolled forward (for EAGLE-3,
ttt_steps steps of fc + one decoder layer + the draft head), the loss, its backward and the
optimizer's step (AdamW, as the trainer's). The loss reads the draft head either fused
(`models.head_loss`: a chunk of rows at a time, never the [tokens, Vd] logits; what training
runs) or unfused (every step's logits materialized whole, then the loss on them: the path
before the fused head). The teacher is the draft ids' rows of the target's head with the full
argmax from `models.teacher.ArgmaxCache` (`cached`: every epoch after the first), or the whole
head in blocks (`full`: the first epoch).

The roof: one step per setting runs under a recorder of its matmuls (every mm / addmm / bmm
with its shapes and dtype) and torch's FLOP counter (the step's FLOPs, attention included);
each distinct matmul shape is then timed alone in fp32 and in bf16. A setting's roof is the
step's FLOPs at those shapes' measured rates (FLOPs outside a recorded matmul at the mean
rate), so `of_roof` = roof time / step time: 1.0 would be a step that is nothing but its
matmuls, each at the speed this machine runs that shape. Settings alternate within each repeat;
the median is reported. The batch has real shape (rows x tokens of the target's width; hidden
states drawn at random: the cost does not depend on their values).

`--peak-rss` instead runs one step of each loss path in its own subprocess and reports the
process's peak resident memory during it (VmHWM, reset just before the step) beside its
resident memory before the step.

    .venv/bin/python -m lab.benchmarks.bench_sft_step --shape smollm2 [--kind KIND --set KEY=INT]
        [--rows 4 --seq 256 --vocab 8192] [--loss both] [--bf16 both] [--teacher cached]
        [--threads N]
    .venv/bin/python -m lab.benchmarks.bench_sft_step --shape smollm2 --rows 1 --seq 4096
        --vocab 32000 --bf16 off --peak-rss
    .venv/bin/python -m lab.benchmarks.bench_sft_step --target DIR ...   (a real target's weights)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from models.drafters import DEFAULT_KIND, KINDS, drafter_class
from models.features import Features
from models.losses import materialized, teacher_draft_probs
from models.target import Target, load_target
from models.teacher import ArgmaxCache
from models.vocab import DraftVocab
from pipeline.core.trainer import native_bf16

SMOLLM2 = dict(  # SmolLM2-135M's config; the drafter copies all but the depth from it
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", type=Path, help="a target directory (load_target)")
    where.add_argument(
        "--shape",
        choices=["smollm2"],
        help="SmolLM2-135M's shape with random weights (no download; the cost does not "
        "depend on the weights' values)",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=4,
        help="target depth with --shape: the drafter's cost does not depend on it (only which "
        "layers it reads), so fewer than SmolLM2's 30 spare memory and start-up",
    )
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256, help="tokens per row (rows x seq a batch)")
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--vocab", type=int, nargs="+", default=[8192])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kind", choices=sorted(KINDS), default=DEFAULT_KIND)
    ap.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=INT",
        help="a setting of --kind's drafter, e.g. anchors=64 (repeatable)",
    )
    ap.add_argument("--bf16", choices=["both", "off", "on"], default="both")
    ap.add_argument("--loss", choices=["both", "fused", "unfused"], default="both")
    ap.add_argument("--teacher", choices=["both", "cached", "full"], default="cached")
    ap.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's)")
    ap.add_argument("--peak-rss", action="store_true", help="peak memory per loss path instead")
    ap.add_argument("--one-step", action="store_true", help=argparse.SUPPRESS)  # --peak-rss's child
    return ap.parse_args(argv)


def smollm2_shaped(layers: int) -> Target:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SMOLLM2, num_hidden_layers=layers)
    aux = (1, max(2, layers // 2), layers - 1)  # any three: the cost is the same
    return Target.from_model(LlamaForCausalLM(config).eval(), aux_layer_ids=aux)


class MatmulRecorder(TorchDispatchMode):
    """Counts every matmul a region runs: (op, input shapes, dtype) -> calls."""

    OPS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[tuple[str, tuple[tuple[int, ...], ...], str]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in self.OPS:
            operands = args[1:] if name == "aten.addmm.default" else args
            shapes = tuple(tuple(t.shape) for t in operands[:2])
            self.calls[(name, shapes, str(operands[0].dtype))] += 1
        return func(*args, **(kwargs or {}))


def matmul_flops(shapes: tuple[tuple[int, ...], ...]) -> int:
    a, b = shapes
    batch = a[0] if len(a) == 3 else 1
    return 2 * batch * a[-2] * a[-1] * b[-1]


def time_matmul(shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype) -> float:
    """Seconds one such product takes (the best of a few, after a warm-up)."""
    a, b = (torch.randn(s).to(dtype) for s in shapes)
    op = torch.bmm if len(shapes[0]) == 3 else torch.mm
    op(a, b)
    best = float("inf")
    reps = max(2, min(20, int(2e9 // max(matmul_flops(shapes), 1))))
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            op(a, b)
        best = min(best, (time.perf_counter() - start) / reps)
    return best


class Step:
    """One SFT step of a drafter on a fixed batch, in one setting."""

    def __init__(self, target: Target, args: argparse.Namespace, v: int) -> None:
        H, V = target.hidden_size, target.vocab_size
        g = torch.Generator().manual_seed(0)
        self.target, self.args = target, args
        self.ids = torch.randint(0, V, (args.rows, args.seq), generator=g)
        self.aux = torch.randn(args.rows, args.seq, 3 * H, generator=g)
        self.last = torch.randn(args.rows, args.seq, H, generator=g)
        self.mask = torch.ones(args.rows, args.seq, dtype=torch.bool)
        counts = torch.bincount(self.ids.reshape(-1), minlength=V).float() + 1
        torch.manual_seed(0)
        settings = {k: int(x) for k, x in (kv.split("=", 1) for kv in args.settings)}
        self.drafter = drafter_class(args.kind).new(
            target, DraftVocab.from_counts(counts, v), settings
        )
        self.module = self.drafter.training_module()
        trainable = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=1e-4)
        vocab = self.drafter.vocab  # MTP's is the whole target vocabulary
        self.cache = ArgmaxCache(target.lm_head_weight, vocab.draft_to_target_ids)
        self.rows, self.lengths = torch.arange(args.rows), self.mask.sum(1)
        self.cache.teacher(self.last, self.rows, self.lengths)  # the first epoch's read fills it

    def __call__(self, bf16: bool, loss_path: str, teacher_mode: str) -> dict[str, float]:
        times = {}
        start = time.perf_counter()
        vocab = self.drafter.vocab
        with torch.no_grad():
            if teacher_mode == "cached":
                logits = self.cache.teacher(self.last, self.rows, self.lengths)
            else:
                logits = self.target.teacher(self.last, vocab, [1.0])
            teacher = teacher_draft_probs(logits, vocab, 1.0)
        times["teacher_s"] = time.perf_counter() - start
        start = time.perf_counter()
        # torch's autocast itself: the trainers' `autocast` falls back to fp32 where bf16
        # would be emulated, and this measures what that fallback avoids
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            features = Features(self.ids, self.aux, self.last)
            (out,) = self.module((features, self.mask, None, self.args.ttt))
        if loss_path == "unfused" and isinstance(out.logits, list):  # the unroll's HeadLogits
            out.logits = [materialized(x) for x in out.logits]
        loss = self.drafter.sft_loss(out, teacher, self.last, decay=0.8, objective=None)
        times["forward_s"] = time.perf_counter() - start
        start = time.perf_counter()
        loss.backward()
        times["backward_s"] = time.perf_counter() - start
        start = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        times["optimizer_s"] = time.perf_counter() - start
        return times


def _peak_rss_reset() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def build_target(args: argparse.Namespace) -> Target:
    return smollm2_shaped(args.layers) if args.shape else load_target(args.target)


def one_step(args: argparse.Namespace) -> None:
    """--peak-rss's child: one warm-up-free step of one setting; prints its memory as JSON."""
    step = Step(build_target(args), args, args.vocab[0])
    before = _status_bytes("VmRSS")
    _peak_rss_reset()
    step(args.bf16 == "on", args.loss, args.teacher)
    print(json.dumps({"rss_before_step": before, "peak_rss": _status_bytes("VmHWM")}))


def peak_rss(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    paths = ["unfused", "fused"] if args.loss == "both" else [args.loss]
    bf16 = {"both": "off", "off": "off", "on": "on"}[args.bf16]
    rows = []
    for path in paths:
        child = [*argv, "--one-step", "--loss", path, "--bf16", bf16, "--teacher", "cached"]
        child = [a for a in child if a != "--peak-rss"]
        done = subprocess.run(
            [sys.executable, "-m", "lab.benchmarks.bench_sft_step", *child],
            capture_output=True,
            text=True,
            check=True,
        )
        got = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(
            {
                "loss": path,
                "bf16": bf16 == "on",
                "rss_before_step_mb": round(got["rss_before_step"] / 2**20),
                "peak_rss_mb": round(got["peak_rss"] / 2**20),
                "step_peak_above_before_mb": round(
                    (got["peak_rss"] - got["rss_before_step"]) / 2**20
                ),
            }
        )
    if len(rows) == 2:
        rows[1]["peak_rss_vs_unfused"] = round(rows[1]["peak_rss_mb"] / rows[0]["peak_rss_mb"], 3)
    return {"peak_rss": rows}


def roofs(step: Step, settings: list[tuple[bool, str, str]]) -> dict[tuple, dict[str, float]]:
    """Per setting: the step's FLOPs and its roof time at this machine's measured rates."""
    rates: dict[tuple, dict[str, float]] = {}
    out = {}
    for setting in settings:
        recorder, counter = MatmulRecorder(), FlopCounterMode(display=False)
        with counter, recorder:
            step(*setting)
        total = counter.get_total_flops()
        matmul, roof_s = 0, 0.0
        for (_, shapes, dtype), calls in recorder.calls.items():
            if shapes not in rates:
                rates[shapes] = {}
            if dtype not in rates[shapes]:
                rates[shapes][dtype] = matmul_flops(shapes) / time_matmul(
                    shapes, getattr(torch, dtype.removeprefix("torch."))
                )
            flops = matmul_flops(shapes) * calls
            matmul += flops
            roof_s += flops / rates[shapes][dtype]
        mean_rate = matmul / roof_s if roof_s else float("nan")
        out[setting] = {
            "step_gflop": total / 1e9,
            "matmul_share": matmul / total if total else float("nan"),
            "roof_s": roof_s + (total - matmul) / mean_rate,
            "roof_gflop_per_s": mean_rate / 1e9,
        }
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one_step:
        return one_step(args)
    if args.peak_rss:
        return print(json.dumps(_header(args) | peak_rss(args, argv), indent=1))

    target = build_target(args)
    modes = {"both": (False, True), "off": (False,), "on": (True,)}[args.bf16]
    paths = {"both": ("unfused", "fused"), "fused": ("fused",), "unfused": ("unfused",)}
    teachers = {"both": ("full", "cached"), "cached": ("cached",), "full": ("full",)}
    settings = [
        (bf16, path, teacher)
        for bf16 in modes
        for path in paths[args.loss]
        for teacher in teachers[args.teacher]
    ]
    rows = []
    for v in args.vocab:
        step = Step(target, args, v)
        roof = roofs(step, settings)  # also each setting's warm-up
        times: dict[tuple, dict[str, list[float]]] = {s: {} for s in settings}
        for _ in range(args.repeats):
            for setting in settings:
                for k, x in step(*setting).items():
                    times[setting].setdefault(k, []).append(x)
        tokens = args.rows * args.seq
        for (bf16, path, teacher), t in times.items():
            med = {k: statistics.median(x) for k, x in t.items()}
            seconds = sum(med.values())
            r = roof[(bf16, path, teacher)]
            rows.append(
                {
                    "draft_vocab": v,
                    "bf16": bf16,
                    "loss": path,
                    "teacher": teacher,
                    **{k: round(x, 3) for k, x in med.items()},
                    "step_s": round(seconds, 3),
                    "tokens_per_s": round(tokens / seconds, 1),
                    "step_gflop": round(r["step_gflop"], 1),
                    "matmul_share_of_flops": round(r["matmul_share"], 3),
                    "roof_gflop_per_s": round(r["roof_gflop_per_s"], 1),
                    "achieved_gflop_per_s": round(r["step_gflop"] / seconds, 1),
                    "roof_tokens_per_s": round(tokens / r["roof_s"], 1),
                    "of_roof": round(r["roof_s"] / seconds, 3),
                }
            )
    for r in rows:  # every setting against today's path (unfused fp32) at the same vocab
        base = [
            b
            for b in rows
            if (b["draft_vocab"], b["teacher"], b["loss"], b["bf16"])
            == (r["draft_vocab"], r["teacher"], "unfused", False)
        ]
        if base:
            r["speed_vs_unfused_fp32"] = round(r["tokens_per_s"] / base[0]["tokens_per_s"], 2)
    print(json.dumps(_header(args) | {"settings": rows}, indent=1))


def _header(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "target": str(args.target) if args.target else f"shape:{args.shape}",
        "kind": args.kind,
        "drafter_settings": args.settings,
        "batch_tokens": args.rows * args.seq,
        "ttt_steps": args.ttt,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": native_bf16("cpu"),
    }


if __name__ == "__main__":
    main()
