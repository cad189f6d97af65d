"""`opd see`: a drafter against plain decoding and the n-gram lookup on held-out sets, in
minutes.

Not a stage and no dataset: one pass over the prompts, batch 1, each prompt decoded by plain
target decoding, by the drafter at K and by the registry's training-free baseline (prompt
lookup) one after the other, so the three share the machine's load and plain decoding is timed
once. τ counts every verify step (accepted + 1, the EAGLE/vLLM convention), per set and over
all; at T=0 each decoder's output is compared token for token with plain decoding. The
decoders are the ones `evaluate` runs (`pipeline.core.decoders.decoder`,
`models.decoding.target_generate`).
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from models.decoding import target_generate
from models.drafter import Drafter
from models.vocab import DraftVocab
from pipeline.core.decoders import decoder
from pipeline.core.drafters import baseline_kind


@dataclass
class Tally:
    """One decoder's sums over the prompts (per set for τ)."""

    seconds: float = 0.0
    tokens: int = 0
    identical: int = 0
    prompts: int = 0
    accepted: dict[str, list[int]] = field(default_factory=dict)  # set -> accepted per step

    def tau(self, name: str | None = None) -> float:
        steps = [a for s, acc in self.accepted.items() if name in (None, s) for a in acc]
        return 1 + sum(steps) / len(steps) if steps else 1.0


def cpu_name() -> str:
    """The CPU's model name, torch's kernel level on it and its native bf16 instructions."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    bf16 = [
        name
        for flag, name in (("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX"))
        if flag in flags
    ]
    native = ", ".join(bf16) if bf16 else "no native bf16"
    return f"{model} (torch kernels: {torch.backends.cpu.get_cpu_capability()}; {native})"


def lookup_drafter(target: Any) -> tuple[str, Drafter]:
    """The registry's training-free baseline kind (its title) built for `target`."""
    spec = baseline_kind()
    return spec.title, spec.drafter.new(target, DraftVocab.full(target.vocab_size), {}).eval()


def side_by_side(
    target: Any,
    drafters: dict[str, tuple[Drafter, int]],
    prompts: dict[str, list[list[int]]],
    max_new_tokens: int,
) -> dict[str, Tally]:
    """Plain decoding and each drafter (name -> (drafter, K)) over every prompt of every set,
    in turn per prompt, at T=0, batch 1."""
    tallies = {name: Tally() for name in ("plain", *drafters)}
    decode = {name: decoder(k, None, 0.0, max_new_tokens, 0) for name, (_, k) in drafters.items()}
    for set_name, rows in prompts.items():
        for ids in rows:
            t0 = time.perf_counter()
            plain = target_generate(target, [ids], max_new_tokens, 0.0, 0).sequences[0]
            tallies["plain"].seconds += time.perf_counter() - t0
            tallies["plain"].tokens += len(plain)
            for name, (drafter, _) in drafters.items():
                t0 = time.perf_counter()
                res = decode[name](target, drafter, [ids])
                tally = tallies[name]
                tally.seconds += time.perf_counter() - t0
                tally.tokens += len(res.sequences[0])
                tally.identical += res.sequences[0] == plain
                tally.prompts += 1
                tally.accepted.setdefault(set_name, []).extend(
                    int(a) for a in res.steps["accepted"]
                )
    return tallies


def summary(tallies: dict[str, Tally], labels: dict[str, str], sets: list[str]) -> list[dict]:
    """The result as data (what `table` prints), one entry per decoder, plain decoding first."""
    plain_tps = tallies["plain"].tokens / tallies["plain"].seconds
    out = []
    for name, tally in tallies.items():
        tps = tally.tokens / tally.seconds
        entry = {"decoder": name, "label": labels[name], "tokens_per_s": round(tps, 2)}
        entry["speedup"] = round(tps / plain_tps, 4)
        if name != "plain":
            entry |= {"tau": round(tally.tau(), 4), "identical": tally.identical}
            entry |= {
                "prompts": tally.prompts,
                "tau_by_set": {s: round(tally.tau(s), 4) for s in sets},
            }
        out.append(entry)
    return out


def write_report(path: Path, facts: dict, decoders: list[dict], sets: list[str]) -> None:
    """`opd see --json`: what ran (`facts`), on which CPU, and each decoder's `summary`."""
    report = {"stage": "see", **facts, "sets": sets, "cpu": cpu_name(), "decoders": decoders}
    path.write_text(json.dumps(report, indent=1))


BF16_NOTE = (
    "(bf16: a verify's batched logits round apart from a 1-token step's, so near-ties flip and "
    "outputs part from there; docs/reference.md, Precision. --set target.dtype=float32 decodes "
    "them identically)"
)


def all_identical(tallies: dict[str, Tally]) -> bool:
    """Whether every drafting decoder's outputs equal plain decoding's."""
    return all(t.identical == t.prompts for name, t in tallies.items() if name != "plain")


def table(
    tallies: dict[str, Tally], labels: dict[str, str], sets: list[str], dtype: str
) -> list[str]:
    """The result as text lines: τ (all and per set), tokens/s, speed-up over plain decoding
    and outputs identical to plain decoding's (in bf16, why some may not be)."""
    plain_tps = tallies["plain"].tokens / tallies["plain"].seconds
    width = max(len(label) for label in labels.values()) + 2
    lines = [
        f"{'':<{width}}{'tau':>7}"
        + "".join(f"{s:>11}" for s in sets)
        + f"{'tok/s':>9}{'speed-up':>10}  identical"
    ]
    for name, tally in tallies.items():
        tps = tally.tokens / tally.seconds
        if name == "plain":
            cells = f"{1.0:>7.3f}" + " " * 11 * len(sets)
            lines.append(f"{labels[name]:<{width}}{cells}{tps:>9.1f}{1.0:>9.2f}x")
            continue
        cells = f"{tally.tau():>7.3f}" + "".join(f"{tally.tau(s):>11.3f}" for s in sets)
        lines.append(
            f"{labels[name]:<{width}}{cells}{tps:>9.1f}{tps / plain_tps:>9.2f}x"
            f"  {tally.identical}/{tally.prompts}"
        )
    if dtype == "bfloat16" and not all_identical(tallies):
        lines.append(BF16_NOTE)
    return lines
