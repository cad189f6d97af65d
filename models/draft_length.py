"""The draft length that pays off: a step-cost model of speculative decoding at batch 1,
measured on the machine it runs on, and the side-by-side measurement that checks it.

A verify step that proposes L drafts costs one target forward over L + 1 tokens, the drafter's
forwards, and the decoder's own work; it emits accepted + 1 tokens. So

    tokens/s (K, s) = E[accepted + 1] / E[verify(L + 1) + F * c + o]

with verify(n) the target's seconds for a forward over n tokens, c the seconds of one drafter
forward, o the decoder's seconds per step, and L, F, accepted per step under K drafts and stop
threshold s (`models.drafter.ChainShape.stop_confidence`); each prompt adds its prefill forward
and the token it emits. With no threshold, L = K and E[accepted + 1] = tau(K) =
1 + sum_k prod_{i<=k} alpha_i; F = K for a chain drafter (one forward per draft), F = 1 for a
block drafter (`Drafter.drafts_blocks`: DFlash drafts every slot in one forward, whatever K).

The per-step quantities come from one calibration decode at the deepest K with no threshold:
its log has, per step, the drafts' confidences and how many were accepted. Drafting stops and
acceptance are both decided left to right, so the same step under (K, s) would have proposed
L = min(K, the drafts the stop rule keeps) and accepted min(accepted, L): the prediction replays
each logged step under every setting. (The steps of a shorter chain start at other positions;
the model assumes acceptance does not depend on where a step starts.)
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from models.decoding import SpecConfig, speculative_generate, target_generate
from models.drafter import ChainShape, Drafter, Shape, confident_length
from models.target import Target


@dataclass(frozen=True)
class LoggedStep:
    """One verify step of the calibration decode (K = its deepest chain, no threshold)."""

    accepted: int
    confidence: tuple[float, ...]  # per proposed draft, by offset (the row's budget may cut it)


@dataclass(frozen=True)
class StepCosts:
    verify_s: Mapping[int, float]  # tokens verified in one target forward -> seconds
    drafter_s: float  # one drafter forward
    overhead_s: float = 0.0  # the decoder's own work per verify step
    prefill_s: float = 0.0  # one prompt's prefill forward (it also emits the first token)
    blocks: bool = False  # one drafter forward drafts the whole chain (Drafter.drafts_blocks)


@dataclass(frozen=True)
class Prediction:
    k: int
    threshold: float
    tau: float
    drafts_per_step: float  # L: proposed and verified
    drafter_forwards_per_step: float  # F
    tokens_per_s: float


def tau_from_alpha(alpha: Sequence[float], k: int) -> float:
    """tau(K) = 1 + sum_{k<=K} prod_{i<=k} alpha_i (alpha_i: acceptance given offset i reached)."""
    tau, run = 1.0, 1.0
    for a in alpha[:k]:
        run *= a
        tau += run
    return tau


def tau_change_by_offset(before: Sequence[float], after: Sequence[float]) -> list[float]:
    """How much of tau(after) - tau(before) each draft offset carries (both alpha over the same
    K offsets): offset k's share is what swapping its alpha from `before` to `after` adds once
    offsets 1..k-1 already hold `after`'s. The shares sum to the whole change exactly. An offset
    weighs by the chance of reaching it (the alphas before it), so with a low alpha_1 the later
    offsets cannot move tau much whatever their own alphas do."""
    if len(before) != len(after):
        raise ValueError(f"alphas over {len(before)} and {len(after)} offsets; pass the same K")
    k = len(before)
    shares, prev = [], tau_from_alpha(before, k)
    for i in range(1, k + 1):
        now = tau_from_alpha([*after[:i], *before[i:]], k)
        shares.append(now - prev)
        prev = now
    return shares


def steps_from_log(records: Mapping[str, list], steps: Mapping[str, list]) -> list[LoggedStep]:
    """The calibration decode's `SpecResult.records` / `.steps` as one LoggedStep per step."""
    conf: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for seq, step, offset, c in zip(
        records["sequence"], records["step"], records["offset"], records["confidence"], strict=True
    ):
        conf.setdefault((seq, step), []).append((offset, c))
    out = []
    for seq, step, accepted in zip(
        steps["sequence"], steps["step"], steps["accepted"], strict=True
    ):
        nodes = sorted(conf.get((seq, step), []))
        out.append(LoggedStep(accepted, tuple(c for _, c in nodes)))
    return out


def replay_step(
    step: LoggedStep, k: int, threshold: float, *, blocks: bool = False
) -> tuple[int, int, int]:
    """(drafts proposed L, drafter forwards F, accepted) of a logged step under (K, threshold).

    A chain drafter runs one forward per draft, and a stop after draft L costs the forward that
    drafted the first draft below the threshold (L + 1), unless the chain was full (L = K); the
    stop reads the running product of confidences. A block drafter (`blocks`) runs one forward
    for every slot and the stop cuts the block at its first slot below the threshold, as the
    decoding loop does."""
    budget = min(k, len(step.confidence))
    if threshold > 0:
        conf = torch.tensor([step.confidence[:budget]], dtype=torch.float64)
        kept = int(confident_length(conf, threshold, joint=not blocks)[0])
        forwards = min(budget, kept + 1)
    else:
        kept = forwards = budget
    if blocks:
        forwards = min(budget, 1)
    return kept, forwards, min(step.accepted, kept)


def predict(
    steps: Sequence[LoggedStep],
    costs: StepCosts,
    k: int,
    threshold: float = 0.0,
    prompts: int = 0,
) -> Prediction:
    """The model's tokens/s of K drafts with stop threshold `threshold` (module docstring) over
    the logged steps of `prompts` prompts, each of which also pays a prefill and emits its
    first token there."""
    emitted, seconds = float(prompts), prompts * costs.prefill_s
    drafts = forwards = 0.0
    for step in steps:
        kept, fwd, accepted = replay_step(step, k, threshold, blocks=costs.blocks)
        emitted += accepted + 1
        seconds += costs.verify_s[kept + 1] + fwd * costs.drafter_s + costs.overhead_s
        drafts += kept
        forwards += fwd
    n = max(1, len(steps))
    return Prediction(
        k=k,
        threshold=threshold,
        tau=(emitted - prompts) / n,
        drafts_per_step=drafts / n,
        drafter_forwards_per_step=forwards / n,
        tokens_per_s=emitted / seconds if seconds else float("nan"),
    )


def predict_at_tau(tau: float, costs: StepCosts, k: int) -> Prediction:
    """The model's tokens/s of K drafts with no stop at a mean tau measured elsewhere: a
    projection for a target whose own tau cannot be measured (random weights of a real shape),
    fed with that target's measured costs. Prefill is left out (long decodes amortise it)."""
    forwards = 1 if costs.blocks else k
    seconds = costs.verify_s[k + 1] + forwards * costs.drafter_s + costs.overhead_s
    return Prediction(k, 0.0, tau, float(k), float(forwards), tau / seconds)


def sweep(
    steps: Sequence[LoggedStep],
    costs: StepCosts,
    ks: Iterable[int],
    thresholds: Iterable[float],
    prompts: int = 0,
) -> list[Prediction]:
    thresholds = list(thresholds)
    return [predict(steps, costs, k, s, prompts) for k in ks for s in thresholds]


def ranked(predictions: Sequence[Prediction]) -> list[Prediction]:
    """Fastest predicted first; ties go to the smaller K, then the lower threshold."""
    return sorted(predictions, key=lambda p: (-p.tokens_per_s, p.k, p.threshold))


def decode_all(
    target: Target,
    drafter: Drafter,
    prompts: list[list[int]],
    batch: int,
    temperature: float,
    shape: Shape | None,
    max_new: int,
) -> dict[str, Any]:
    """One decoder (plain when `shape` is None) over all prompts in batches of `batch`."""
    seqs: list[list[int]] = []
    logs: list[tuple[dict, dict]] = []
    totals = {"steps": 0, "emitted": 0, "accepted_plus_1": 0, "forwards": 0}
    inside = {"target": 0.0, "drafter": 0.0}
    per_batch: list[tuple[int, float]] = []  # (tokens, seconds) of each batch
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        began = time.perf_counter()
        if shape is None:
            out = target_generate(target, chunk, max_new, temperature, seed=i).sequences
            seqs += out
            per_batch.append((sum(map(len, out)), time.perf_counter() - began))
            continue
        cfg = SpecConfig(shape, temperature=temperature, max_new_tokens=max_new, seed=i)
        res = speculative_generate(target, drafter, chunk, cfg)
        seqs += res.sequences
        per_batch.append((sum(map(len, res.sequences)), time.perf_counter() - began))
        logs.append((res.records, res.steps))
        totals["steps"] += len(res.steps["accepted"])
        totals["emitted"] += sum(res.steps["emitted"])
        totals["accepted_plus_1"] += sum(a + 1 for a in res.steps["accepted"])
        totals["forwards"] += res.stats["drafter_forwards"]
        inside["target"] += res.stats["target_forward_seconds"]
        inside["drafter"] += res.stats["drafter_forward_seconds"]
    wall = time.perf_counter() - start
    tokens = sum(len(s) for s in seqs)
    out: dict[str, Any] = {
        "wall_s": wall,
        "tokens": tokens,
        "sequences": seqs,
        "logs": logs,
        "per_batch": per_batch,
    }
    if shape is not None:
        steps = max(1, totals["steps"])
        out |= {
            "tau": totals["accepted_plus_1"] / steps,
            "target_forwards_per_token": totals["steps"] / max(1, totals["emitted"]),
            "drafter_forwards_per_step": totals["forwards"] / steps,
            "drafter_s_per_forward": inside["drafter"] / max(1, totals["forwards"]),
            "overhead_s_per_step": (wall - inside["target"] - inside["drafter"]) / steps,
            "drafter_share": inside["drafter"] / wall,
            "target_share": inside["target"] / wall,
        }
    return out


def _wait(device: torch.device) -> None:
    """Block until the device's queued work is done: CUDA runs kernels asynchronously, so a
    forward timed without this counts only its launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_verify(
    target: Target, prompts: list[list[int]], max_new: int, widths: range, reps: int
) -> dict[int, float]:
    """Median seconds of one batch-1 target forward over n new tokens, for each n in `widths`,
    on a cache of the prompts' mean length + max_new / 2 (the middle of a decode), with the
    explicit mask the decoding loop passes."""
    device = target.device
    context = int(statistics.mean(map(len, prompts))) + max_new // 2
    ids = torch.tensor(prompts[0] * (context // len(prompts[0]) + 1), device=device)[:context]
    cache = target.new_cache()
    mask = torch.ones(1, context, context, dtype=torch.bool, device=device).tril()
    target.forward(
        ids[None],
        position_ids=torch.arange(context, device=device)[None],
        attention_mask=mask,
        cache=cache,
    )
    times: dict[int, list[float]] = {n: [] for n in widths}
    for _ in range(reps + 1):  # the first round warms up
        for n in widths:
            new = ids[:n][None]
            local = torch.ones(n, n, dtype=torch.bool, device=device).tril()
            full = torch.cat([torch.ones(n, context, dtype=torch.bool, device=device), local], 1)
            _wait(device)
            start = time.perf_counter()
            target.forward(
                new,
                position_ids=torch.arange(context, context + n, device=device)[None],
                attention_mask=full[None],
                cache=cache,
            )
            _wait(device)
            times[n].append(time.perf_counter() - start)
            target.crop_cache(cache, context)
    return {n: statistics.median(t[1:]) for n, t in times.items()}


def measure_prefill(target: Target, prompts: list[list[int]]) -> float:
    """Mean seconds of one prompt's batch-1 prefill forward (the decoding loop's mask)."""
    seconds = []
    for prompt in prompts:
        n = len(prompt)
        mask = torch.ones(1, n, n, dtype=torch.bool, device=target.device).tril()
        _wait(target.device)
        start = time.perf_counter()
        _, last = target.forward_features(
            torch.tensor([prompt], device=target.device),
            position_ids=torch.arange(n, device=target.device)[None],
            attention_mask=mask,
            cache=target.new_cache(),
        )
        target.logits_from_hidden(last[:, -1])  # as the prefill: the head at the last position
        _wait(target.device)
        seconds.append(time.perf_counter() - start)
    return statistics.mean(seconds)


THRESHOLDS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


@dataclass(frozen=True)
class TuneOptions:
    max_new_tokens: int
    thresholds: tuple[float, ...] = THRESHOLDS
    repeats: int = 1  # best of N per decoder (the least disturbed run on a shared machine)
    verify_reps: int = 20  # timings per verify width (their median)
    candidates: int = 1  # the best predicted settings measured


def calibrate(
    target: Target,
    drafter: Drafter,
    prompts: list[list[int]],
    temperature: float,
    depth: int,
    opts: TuneOptions,
) -> tuple[list[LoggedStep], StepCosts, dict[str, Any]]:
    """The calibration decode (K = depth, no stop; the fastest of `repeats`) and the measured
    costs: its steps, StepCosts, and the run."""
    shape = ChainShape(depth)
    decode_all(target, drafter, prompts[:1], 1, temperature, shape, 4)  # warm-up
    runs = [
        decode_all(target, drafter, prompts, 1, temperature, shape, opts.max_new_tokens)
        for _ in range(opts.repeats)
    ]
    run = min(runs, key=lambda r: r["wall_s"])
    logged = [s for records, steps in run["logs"] for s in steps_from_log(records, steps)]
    widths = range(1, depth + 2)
    costs = StepCosts(
        verify_s=measure_verify(target, prompts, opts.max_new_tokens, widths, opts.verify_reps),
        drafter_s=run["drafter_s_per_forward"],
        overhead_s=run["overhead_s_per_step"],
        prefill_s=measure_prefill(target, prompts),
        blocks=drafter.drafts_blocks,
    )
    return logged, costs, run


def measure_side_by_side(
    target: Target,
    drafter: Drafter,
    prompts: list[list[int]],
    temperature: float,
    shapes: Mapping[str, Shape | None],
    opts: TuneOptions,
) -> dict[str, dict[str, Any]]:
    """Each decoder (None: plain) over all prompts at batch 1, after a warm-up of each,
    alternating, the fastest of `repeats`; rows with tokens/s and speed-up over plain, and each
    prompt's tokens/s in its least disturbed repeat (a prompt decodes the same tokens in every
    repeat: its seed is its index)."""
    for shape in shapes.values():
        decode_all(target, drafter, prompts[:1], 1, temperature, shape, 4)
    runs: dict[str, list[dict]] = {name: [] for name in shapes}
    for _ in range(opts.repeats):
        for name, shape in shapes.items():
            runs[name].append(
                decode_all(target, drafter, prompts, 1, temperature, shape, opts.max_new_tokens)
            )
    fastest = {name: min(r, key=lambda x: x["wall_s"]) for name, r in runs.items()}
    rows = {name: _row(run, fastest["plain"], temperature) for name, run in fastest.items()}
    for name, repeats in runs.items():
        rows[name]["per_prompt_tokens_per_s"] = [
            round(tokens / min(run["per_batch"][i][1] for run in repeats), 3)
            for i, (tokens, _) in enumerate(repeats[0]["per_batch"])
        ]
    return rows


# One-sided 95% quantiles of Student's t for 1..10 degrees of freedom; past 10, the normal's.
_T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812)


def faster_beyond_noise(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether decoder `a` is faster than `b` on the same prompts beyond the prompts' spread:
    a, b are tokens/s per prompt (paired); the one-sided 95% lower bound of the mean log ratio
    is above 0. One prompt never separates them."""
    d = [math.log(x / y) for x, y in zip(a, b, strict=True)]
    if len(d) < 2:
        return False
    t = _T95[len(d) - 2] if len(d) - 2 < len(_T95) else 1.645
    return statistics.fmean(d) - t * statistics.stdev(d) / math.sqrt(len(d)) > 0


def choose(measured: Mapping[str, Mapping[str, Any]], names: Sequence[str]) -> tuple[str, str]:
    """Among the measured settings `names` (rows of `tune`'s "measured"), the one to serve and
    what chose it: the predicted fastest ("predicted"), unless another is measured faster on
    the same prompts beyond their spread ("measured": the fastest such). The prediction replays
    the same logged steps under every setting, so it compares them on equal draws; a timing of
    a few prompts does not: at T=1 a long K can out-sample a short one on three prompts by
    chance and lose on the next thirty. Predicted ties go to the smaller K, then threshold."""

    def rank(n: str) -> tuple[float, int, float]:
        row = measured[n]
        return (-row["predicted"]["tokens_per_s"], row["setting"]["k"], row["setting"]["threshold"])

    ref = min(names, key=rank)
    per_prompt = {n: measured[n]["per_prompt_tokens_per_s"] for n in names}
    beat = [n for n in names if n != ref and faster_beyond_noise(per_prompt[n], per_prompt[ref])]
    if not beat:
        return ref, "predicted"
    return max(beat, key=lambda n: measured[n]["tokens_per_s"]), "measured"


def tune(
    target: Target,
    drafter: Drafter,
    prompts: list[list[int]],
    temperature: float,
    depth: int,
    default_k: int,
    opts: TuneOptions,
) -> dict[str, Any]:
    """Calibrate, predict every K <= depth and threshold, then measure plain, the default
    (K = default_k, no stop), the `candidates` best predicted settings and the best predicted
    without a threshold side by side.
    `chosen` is the setting `choose` picks among them."""
    logged, costs, calib = calibrate(target, drafter, prompts, temperature, depth, opts)
    n = len(prompts)
    predictions = sweep(logged, costs, range(1, depth + 1), opts.thresholds, n)
    predicted = {"default": predict(logged, costs, default_k, prompts=n)}
    for i, p in enumerate(ranked(predictions)[: opts.candidates]):
        predicted["best" if i == 0 else f"candidate_{i + 1}"] = p
    # vLLM serves a fixed K: the best one without a threshold is timed too, else a stop
    # threshold on every candidate would leave the trained K the only fixed K to serve.
    fixed = ranked([p for p in predictions if p.threshold == 0])[:1]
    if fixed and fixed[0] not in predicted.values():
        predicted["best_fixed"] = fixed[0]
    shapes: dict[str, Shape | None] = {"plain": None}
    shapes |= {name: ChainShape(p.k, p.threshold) for name, p in predicted.items()}
    measured = measure_side_by_side(target, drafter, prompts, temperature, shapes, opts)
    plain_tps = measured["plain"]["tokens_per_s"]
    measured["calibration"] = _row(calib, {"tokens": plain_tps, "wall_s": 1.0}, temperature)
    predicted["calibration"] = predict(logged, costs, depth, prompts=n)
    for name, p in predicted.items():
        measured[name]["predicted"] = _prediction(p, plain_tps)
        measured[name]["setting"] = {"k": p.k, "threshold": p.threshold}
    spec = [name for name in predicted if name != "calibration"]
    chosen, by = choose(measured, spec)
    return {
        "temperature": temperature,
        "chosen": {"name": chosen, "by": by, **measured[chosen]["setting"]}
        | {"speedup_vs_plain": measured[chosen]["speedup_vs_plain"]},
        "calibration_steps": len(logged),
        "costs": _costs_report(costs),
        "measured": measured,
        "sweep": [_prediction(p, plain_tps) for p in predictions],
    }


def _costs_report(costs: StepCosts) -> dict[str, Any]:
    one = costs.verify_s[1]
    return {
        "verify_s_by_tokens": {n: round(s, 6) for n, s in costs.verify_s.items()},
        "verify_rel_to_one_token": {n: round(s / one, 3) for n, s in costs.verify_s.items()},
        "drafter_s_per_forward": round(costs.drafter_s, 6),
        "drafter_rel_to_one_token_verify": round(costs.drafter_s / one, 3),
        "overhead_s_per_step": round(costs.overhead_s, 6),
        "prefill_s_per_prompt": round(costs.prefill_s, 6),
    }


def _row(run: dict[str, Any], plain: dict[str, Any], temperature: float) -> dict[str, Any]:
    tps = run["tokens"] / run["wall_s"]
    row = {"tokens_per_s": round(tps, 2), "wall_s": round(run["wall_s"], 3)}
    if "tau" in run:
        keys = ("tau", "target_forwards_per_token", "drafter_forwards_per_step", "drafter_share")
        row |= {k: round(run[k], 4) for k in keys}
        row["speedup_vs_plain"] = round(tps / (plain["tokens"] / plain["wall_s"]), 3)
        if temperature == 0 and "sequences" in plain:  # the calibration's plain is a rate only
            row["lossless"] = run["sequences"] == plain["sequences"]
    return row


def _prediction(p: Prediction, plain_tps: float) -> dict[str, Any]:
    return {
        "k": p.k,
        "threshold": p.threshold,
        "tau": round(p.tau, 4),
        "drafts_per_step": round(p.drafts_per_step, 3),
        "drafter_forwards_per_step": round(p.drafter_forwards_per_step, 3),
        "tokens_per_s": round(p.tokens_per_s, 2),
        "speedup_vs_plain": round(p.tokens_per_s / plain_tps, 3),
    }
