"""Inside vLLM, on the same benchmark prompts at batch 1: plain decoding, vLLM's free n-gram
(prompt-lookup) speculation, and each exported drafter, measured side by side in one run.

Every prompt is decoded by every engine in turn (plain, n-gram, then the exports in the order
given, each prompt starting one engine further on), so a noisy machine slows them alike;
speed-ups are ratios of summed tokens over summed seconds within this run. At T=0 each speculative output is compared with plain decoding's.
Prompts are the held-out sets the prompts stage reads (`question.jsonl` files, `humaneval`),
first turns rendered with the target's chat template. Prints one JSON object.

    .venv/bin/python -m lab.benchmarks.bench_vllm_real --target DIR \\
        --sets ../shared/data/prompts/mt_bench.jsonl ../shared/data/prompts/gsm8k.jsonl humaneval \\
        --export EXPORT_DIR [--export METHOD=DIR2] --k 1 2 3 \\
        --prompts-per-set 24 --max-new-tokens 256

An export is served with its kind's vLLM method (read from its `opd_drafter.json`), or with
METHOD when given (a directory `opd export` did not write); every export is served at each K
given. The result names each engine's `vllm serve`
command: the same model, dtype and speculative config the run measured.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import operator
import sys
import time
from collections import Counter
from pathlib import Path

from models import vllm_engine
from models.drafters import kind_spec
from models.vllm_engine import EngineSpec
from pipeline.core.drafters import baseline_kind
from pipeline.core.export import DRAFTER_RECORD


def benchmark_prompts(target_dir: Path, sets: list[str], per_set: int) -> list[tuple[str, list]]:
    """(set name, prompt ids) for the first `per_set` prompts of each set, taking the sets in
    turn (a run stopped by --deadline-s has decoded every set alike)."""
    from transformers import AutoTokenizer

    from pipeline.stages.prompts import PromptsConfig, heldout_rows

    tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    cfg = PromptsConfig(heldout_sets=sets, max_heldout_rows=per_set, max_prompt_tokens=4096)
    by_set: dict[str, list] = {}
    for r in heldout_rows(cfg, tokenizer, Counter()):
        by_set.setdefault(r["source"].split(":")[0], []).append(r["prompt_ids"])
    turns = itertools.zip_longest(*([(name, ids) for ids in rows] for name, rows in by_set.items()))
    return [pair for turn in turns for pair in turn if pair is not None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, required=True, help="the target's HF directory")
    ap.add_argument("--sets", nargs="+", required=True)
    ap.add_argument(
        "--export",
        action="append",
        default=[],
        metavar="[METHOD=]DIR",
        help="an `opd export` directory (served with its kind's vLLM method), or METHOD=DIR",
    )
    ap.add_argument(
        "--k",
        type=int,
        nargs="+",
        default=[6],
        help="drafted tokens per step for the exports: one engine per export and K",
    )
    ap.add_argument("--lookup-k", type=int, default=4, help="prompt lookup's K")
    ap.add_argument("--prompts-per-set", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--deadline-s",
        type=float,
        help="take no further prompt once this many seconds have passed since the start (engine "
        "starts included); the result counts the prompts every engine decoded",
    )
    args = ap.parse_args()

    begun = time.perf_counter()
    prompts = benchmark_prompts(args.target, args.sets, args.prompts_per_set)
    plain = EngineSpec(str(args.target), args.dtype)
    lookup = baseline_kind().serve_method  # vLLM's method for prompt lookup
    engines = {"plain": plain, lookup: lookup_engine(args)}
    for item in args.export:
        method, directory = export_method(item)
        for k in args.k:
            engines[f"{method} K={k}"] = EngineSpec(
                str(args.target), args.dtype, str(Path(directory).resolve()), k, method=method
            )
    try:
        result = measure(args, engines, prompts, begun)
    finally:  # a run stopped by Ctrl-C (or `timeout -s INT`) leaves no engine behind
        vllm_engine.close()
    print(json.dumps(result, indent=1))


def export_method(item: str) -> tuple[str, str]:
    """(vLLM method, directory) for `--export [METHOD=]DIR`: without METHOD, the method of the
    kind the export's `opd_drafter.json` records."""
    method, sep, directory = item.partition("=")
    if sep:
        return method, directory
    record = Path(item) / DRAFTER_RECORD
    if not record.is_file():
        raise SystemExit(f"--export {item}: no {DRAFTER_RECORD} there; give METHOD=DIR")
    return kind_spec(json.loads(record.read_text())["drafter_kind"]).serve_method, item


def lookup_engine(args: argparse.Namespace) -> EngineSpec:
    """vLLM's prompt lookup as the project's training-free kind serves it by default."""
    kind = baseline_kind()
    vocab = json.loads((args.target / "config.json").read_text())["vocab_size"]
    served = kind.drafter(kind.drafter.config_type(vocab)).speculative_config(
        args.target, args.lookup_k
    )
    method, k = served.pop("method"), served.pop("num_speculative_tokens")
    return EngineSpec(
        str(args.target), args.dtype, None, k, method=method, options=tuple(sorted(served.items()))
    )


def measure(
    args: argparse.Namespace,
    engines: dict[str, EngineSpec],
    prompts: list[tuple[str, list]],
    begun: float,
) -> dict:
    for spec in engines.values():
        vllm_engine.start(spec)
        # its first request pays one-off allocations: not part of any prompt's time
        vllm_engine.generate(spec, [prompts[0][1]], max_new_tokens=4)
    lookup = baseline_kind().serve_method
    config = json.loads((args.target / "generation_config.json").read_text())
    eos = config.get("eos_token_id")
    stop = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())

    seconds = {n: Counter() for n in engines}
    tokens = {n: Counter() for n in engines}
    counters: dict[str, dict[str, vllm_engine.SpecCounters]] = {n: {} for n in engines}
    same = {n: Counter() for n in engines}
    count: Counter[str] = Counter()
    for i, (group, ids) in enumerate(prompts):
        if args.deadline_s is not None and time.perf_counter() - begun > args.deadline_s:
            print(f"deadline: stopped after {i} of {len(prompts)} prompts", file=sys.stderr)
            break
        count[group] += 1
        outs, spent_s = {}, {}
        # each prompt starts at the next engine: none always runs right after the same one
        order = list(engines)[i % len(engines) :] + list(engines)[: i % len(engines)]
        for name in order:
            spec = engines[name]
            started = time.perf_counter()
            if name == "plain":
                out = vllm_engine.generate(
                    spec, [ids], max_new_tokens=args.max_new_tokens, stop_ids=stop
                )[0][0]
            else:
                drafted, spent = vllm_engine.speculate(
                    spec, [ids], max_new_tokens=args.max_new_tokens, stop_ids=stop
                )
                out = drafted[0]
                old = counters[name].get(group)
                counters[name][group] = spent if old is None else old + spent
            spent_s[name] = time.perf_counter() - started
            seconds[name][group] += spent_s[name]
            tokens[name][group] += len(out)
            outs[name] = out
        for name, out in outs.items():
            same[name][group] += out == outs["plain"]
        took = ", ".join(f"{n} {s:.1f}s" for n, s in spent_s.items())
        print(f"prompt {i + 1}/{len(prompts)} ({group}): {took}", file=sys.stderr, flush=True)

    def row(name: str, groups: list[str]) -> dict:
        t = sum(tokens[name][g] for g in groups)
        s = sum(seconds[name][g] for g in groups)
        base = sum(tokens["plain"][g] for g in groups) / sum(seconds["plain"][g] for g in groups)
        out = {"tokens_per_s": t / s, "speedup_vs_plain": (t / s) / base}
        if name != "plain":
            total = functools.reduce(operator.add, (counters[name][g] for g in groups))
            out |= {
                "tau": total.tau,
                "identical_to_plain": sum(same[name][g] for g in groups)
                / sum(count[g] for g in groups),
            }
        return out

    groups = list(count)
    return {
        "target": str(args.target),
        "batch_size": 1,
        "temperature": 0,
        "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype,
        "k": {lookup: args.lookup_k, "exports": args.k},
        "prompt_lookup_sizes": dict(engines[lookup].options),
        "prompts": dict(count),
        "prompts_asked": args.prompts_per_set,
        "by_set": {g: {n: row(n, [g]) for n in engines} for g in groups},
        "all": {n: row(n, groups) for n in engines},
        "serve": {n: vllm_engine.serve_command(spec) for n, spec in engines.items()},
    }


if __name__ == "__main__":
    main()
