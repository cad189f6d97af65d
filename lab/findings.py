"""Render docs/findings.md's (and README's) tables from the published reports (lab/published/).

A table in those files is the text between `<!-- findings: KIND PATTERN [OPTION] -->` and
`<!-- /findings -->`; this module rewrites it from every published report whose name matches
the glob PATTERN, so the numbers there are never typed. KIND is one of:

- `opd-vs-sft`: Draft-OPD against continued SFT, both temperatures (option `worse`: only the
  rows where Draft-OPD is behind);
- `eval`: evaluations (τ, speed-up over plain decoding, the training-free lookup beside it);
- `stage-costs`: a `bench_scale_shape` run: every stage's rate, memory and bytes a token
  (option `round1`: the first Draft-OPD round's stages only);
- `projected`: the speed-up the same run's step costs project at the embedded target's τ.
- `see`: `opd see --json` results: a shipped drafter against plain decoding and the n-gram
  lookup on the held-out sets (τ over every verify step, per set, speed-up, identical outputs);
- `vllm`: `lab/benchmarks/bench_vllm_real.py` results: exports and vLLM's n-gram speculator
  served by vLLM against vLLM's plain decoding, side by side in one run;
- `sft-step`: `lab/benchmarks/bench_sft_step.py` results: one SFT step's tokens/s per dtype and
  loss path beside the matmul roof of its own shapes, measured side by side in one run;
- `sft-curve`: SFT's held-out τ against the generated training tokens it read (a JSON whose
  `points` are one SFT run each: `lab/gpu/smollm2_scale.py`'s record, with token counts).

    python -m lab.findings            # rewrite docs/findings.md and README.md's tables
    python -m lab.findings --check    # exit 1 when they are not what the published reports give
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lab.publish import MANIFEST, PROVENANCE, PUBLISHED, RESULT
from models.drafters import DEFAULT_KIND, KINDS

REPO = Path(__file__).resolve().parents[1]
FINDINGS = REPO / "docs" / "findings.md"
DOCS = (FINDINGS, REPO / "README.md")  # the files whose tables come from published reports
BLOCK = re.compile(
    r"(<!-- findings: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- /findings -->)", re.S
)


class Published:
    """One folder of lab/published/: its manifest (datasets), result JSON and provenance."""

    def __init__(self, path: Path):
        self.path = path
        self.name = path.name
        self.provenance = self._json(PROVENANCE) or {}
        self.manifest = self._json(MANIFEST) or {}
        self.result = self._json(RESULT) or {}

    def _json(self, name: str) -> dict[str, Any] | None:
        file = self.path / name
        return json.loads(file.read_text()) if file.is_file() else None

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest.get("meta", {})

    @property
    def stage(self) -> str | None:
        return self.manifest.get("stage")

    def link(self, docs: Path) -> str:
        """A link from the `docs` file to the report (its report.md, else its provenance)."""
        target = self.path / ("report.md" if (self.path / "report.md").is_file() else PROVENANCE)
        return f"[{self.name}]({Path(os.path.relpath(target, docs.parent)).as_posix()})"

    @property
    def hardware(self) -> str:
        return self.provenance.get("hardware") or "–"


def _title(kind: str | None) -> str:
    """A kind as users name it (EAGLE-3, DFlash, ...)."""
    return KINDS[kind].title if kind in KINDS else "–"


def published(pattern: str, root: Path = PUBLISHED) -> list[Published]:
    dirs = sorted(p for p in root.glob("*") if p.is_dir() and not p.name.startswith("."))
    return [Published(p) for p in dirs if fnmatch.fnmatch(p.name, pattern)]


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def _spread(values: list[float]) -> str:
    """mean ± standard deviation over seeds (the mean alone for one seed)."""
    if len(values) < 2:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"


def opd_vs_sft_rows(reports: list[Published], docs: Path, option: str) -> Iterator[list[str]]:
    for r in (r for r in reports if r.stage == "opd-vs-sft"):
        m = r.meta
        for t, s in (("0", ""), ("1", "_t1")):
            ratio = m[f"opd_over_sft_continued{s}"]
            if option == "worse" and ratio >= 1:
                continue
            per_seed = ", ".join(f"{x:.3f}" for x in m[f"opd_over_sft_continued{s}_per_seed"])
            yield [
                r.link(docs),
                _title(r.result.get("drafter_kind")),
                str(len(m[f"tau_opd{s}_per_seed"])),
                t,
                f"{m[f'tau_sft_warmup{s}']:.3f}",
                _spread(m[f"tau_sft_continued{s}_per_seed"]),
                _spread(m[f"tau_opd{s}_per_seed"]),
                f"**{ratio:.3f}** ({per_seed})",
            ]


def eval_rows(reports: list[Published], docs: Path, option: str) -> Iterator[list[str]]:
    for r in (r for r in reports if r.stage == "evaluate"):
        m = r.meta
        free = m.get("free_baseline") or {}
        lookup = f"{free['tau']:.3f}" if "tau" in free else "–"
        if "speedup" in free:
            lookup += f" ({free['speedup']:.2f}×)"
        yield [
            r.link(docs),
            _title(r.provenance.get("drafter_kind")),
            f"{m['temperature']:g}",
            str(m["k"]),
            str(m["prompts"]),
            f"{m['tau']:.3f}",
            f"{m['speedup']:.2f}×" if "speedup" in m else "–",
            lookup,
            r.hardware,
        ]


def _gb(n: int | None) -> str:
    return f"{n / 1e9:.1f}" if n else "–"


def stage_cost_rows(reports: list[Published], docs: Path, option: str) -> Iterator[list[str]]:
    for r in (r for r in reports if "stages" in r.result):
        kind = _title(r.result.get("drafter_kind") or DEFAULT_KIND)  # older runs: the default
        for stage, c in r.result["stages"].items():
            if not c.get("tokens") or (option == "round1" and stage.endswith("-r2")):
                continue  # no per-token work (the prompts stage), or a later round's repeat
            per_token = c.get("bytes_per_token")
            yield [
                r.link(docs),
                kind,
                stage,
                c["unit"],
                f"{c['tokens_per_s']:,.1f}",
                _gb(c.get("peak_gpu_bytes")),
                _gb(c.get("peak_host_bytes")),
                f"{per_token:,.0f}" if per_token else "–",
                r.hardware,
            ]


def projected_rows(reports: list[Published], docs: Path, option: str) -> Iterator[list[str]]:
    for r in (r for r in reports if "projected_speedup" in r.result):
        costs = r.result["step_costs"]
        forward = costs["verify_s"]["1"]
        taus = r.result.get("projected_at_tau", {})
        for arm, speedup in r.result["projected_speedup"].items():
            yield [
                r.link(docs),
                _title(r.result.get("drafter_kind") or DEFAULT_KIND),
                f"{forward * 1e3:.1f} ms",
                f"{costs['drafter_s_per_forward'] * 1e3:.2f} ms",
                arm.replace("_", " "),
                f"{taus[arm]:.3f}" if arm in taus else "–",
                f"**{speedup:.2f}×**",
                r.hardware,
            ]


def see_rows(reports: list[Published], docs: Path, option: str) -> Iterator[list[str]]:
    for r in (r for r in reports if r.result.get("stage") == "see"):
        res = r.result
        for d in (d for d in res["decoders"] if d["decoder"] != "plain"):
            by_set = ", ".join(f"{s} {t:.3f}" for s, t in d["tau_by_set"].items())
            yield [
                r.link(docs),
                d["label"],
                f"**{d['tau']:.3f}** ({by_set})",
                f"**{d['speedup']:.2f}×**",
                f"{d['identical']}/{d['prompts']}",
                f"{res['cpu']}, {res['dtype']}, {res['threads']} threads",
            ]


def vllm_rows(reports: list[Published], docs: Path, option: str) -> Iterator[list[str]]:
    for r in (r for r in reports if "serve" in r.result):
        res = r.result
        prompts = sum(res["prompts"].values())
        for name, one in ((n, o) for n, o in res["all"].items() if n != "plain"):
            label = name if " K=" in name else f"{name} K={res['k'][name]}"
            by_set = ", ".join(
                f"{s} {one_set[name]['tau']:.3f}" for s, one_set in res["by_set"].items()
            )
            yield [
                r.link(docs),
                label,
                f"**{one['tau']:.3f}** ({by_set})",
                f"**{one['speedup_vs_plain']:.2f}×**",
                f"{round(one['identical_to_plain'] * prompts)}/{prompts}",
                f"{one['tokens_per_s']:.1f} ({res['all']['plain']['tokens_per_s']:.1f})",
                f"{res['dtype']}, {r.hardware}",
            ]


def sft_curve_rows(reports: list[Published], docs: Path, option: str) -> Iterator[list[str]]:
    for r in reports:
        for p in sorted(r.result.get("points", []), key=lambda p: p["generated_tokens"]):
            yield [
                r.link(docs),
                f"{p['share']:g}",
                f"{p['train_sequences']:,}",
                f"{p['generated_tokens'] / 1e6:.2f}M",
                str(p["steps"]),
                f"{p['epochs']:.1f}",
                f"{p['acc'][0]:.3f}",
                f"**{p['tau_sim']:.3f}**",
                f"{p['tau_chain']:.3f}",
                r.hardware,
            ]


def sft_step_rows(reports: list[Published], docs: Path, option: str) -> Iterator[list[str]]:
    for r in (r for r in reports if "batch_tokens" in r.result):
        res = r.result
        for s in res["settings"]:
            yield [
                r.link(docs),
                _title(res["kind"]),
                f"{res['batch_tokens']:,} x {res['ttt_steps']}",
                "bf16" if s["bf16"] else "fp32",
                s["loss"],
                f"{s['tokens_per_s']:,.1f}",
                f"{s['roof_gflop_per_s']:,.0f}",
                f"**{s['of_roof']:.2f}**",
                f"{s['speed_vs_unfused_fp32']:.2f}×",
                f"{res['cpu_capability']}, {res['threads']} threads; {r.hardware}",
            ]


def target_dtypes_rows(reports: list[Published], docs: Path, option: str) -> Iterator[list[str]]:
    for r in (r for r in reports if "workloads" in r.result):
        res = r.result
        auto = "bf16" if res["native_bf16"] else "fp32"
        for name, w in res["workloads"].items():
            yield [
                r.link(docs),
                name,
                f"{w['fp32_s'] * 1e3:,.1f}",
                f"{w['bf16_s'] * 1e3:,.1f}",
                f"**{w['bf16_speedup']:.2f}×**",
                auto,
                f"{res['cpu_capability']}, {res['threads']} threads; {r.hardware}",
            ]


TABLES: dict[str, tuple[str, Callable[[list[Published], Path, str], Iterator[list[str]]]]] = {
    # kind: (the table's header, its rows from the reports)
    "opd-vs-sft": (
        "report | kind | seeds | T | SFT warm-up τ | continued SFT τ | Draft-OPD τ | Draft-OPD / "
        "continued SFT (per seed)",
        opd_vs_sft_rows,
    ),
    "eval": (
        "report | kind | T | K | prompts | τ | speed-up over plain decoding | n-gram lookup τ "
        "(speed-up) | hardware",
        eval_rows,
    ),
    "stage-costs": (
        "report | kind | stage | unit of work | units/s | peak GPU GB | peak host GB | bytes "
        "written a unit | hardware",
        stage_cost_rows,
    ),
    "projected": (
        "report | kind | target forward | drafter forward | drafter (embedded target's τ) | τ | "
        "projected speed-up | hardware",
        projected_rows,
    ),
    "sft-curve": (
        "report | data share | training requests | generated tokens | steps | epochs | "
        "held-out first-draft agreement | held-out τ_sim (K=6) | τ_chain | hardware",
        sft_curve_rows,
    ),
    "sft-step": (
        "report | kind | tokens a step x unrolled steps | dtype | loss | tokens/s | matmul roof "
        "GFLOP/s (the step's shapes) | of the roof | vs unfused fp32 | torch kernels; hardware",
        sft_step_rows,
    ),
    "target-dtypes": (
        "report | target workload | fp32 ms | bf16 ms | bf16 speed-up | `auto` there | CPU "
        "capability, threads; hardware",
        target_dtypes_rows,
    ),
    "see": (
        "report | decoder | τ (per set) | speed-up over plain decoding | identical to plain | "
        "hardware",
        see_rows,
    ),
    "vllm": (
        "report | vLLM speculator | τ (per set) | speed-up over vLLM plain decoding | identical to "
        "plain | tokens/s (plain) | dtype, hardware",
        vllm_rows,
    ),
}


def render_block(spec: str, docs: Path, root: Path = PUBLISHED) -> str:
    kind, pattern, *option = spec.split()
    if kind not in TABLES:
        raise SystemExit(f"error: {docs}: unknown findings table {kind!r}; one of {sorted(TABLES)}")
    header, rows_of = TABLES[kind]
    reports = published(pattern, root)
    rows = list(rows_of(reports, docs, option[0] if option else ""))
    if rows:
        return _table(header.split(" | "), rows)
    if reports:
        return f"_None of the {len(reports)} reports published as `{pattern}` has such a row._\n"
    return (
        f"_No report published as `{pattern}` yet: `opd publish REF --as NAME`, then "
        "`python -m lab.findings`._\n"
    )


def render(text: str, docs: Path = FINDINGS, root: Path = PUBLISHED) -> str:
    """`text` with every findings table rendered anew from the reports under `root`."""
    return BLOCK.sub(
        lambda m: m.group(1) + render_block(m.group("spec"), docs, root) + m.group(4), text
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a file is out of date")
    args = ap.parse_args(argv)
    stale = []
    for docs in DOCS:
        text = docs.read_text()
        new = render(text, docs)
        if new != text:
            stale.append(docs)
            if not args.check:
                docs.write_text(new)
    if args.check and stale:
        names = ", ".join(str(p.relative_to(REPO)) for p in stale)
        print(f"{names}: not what the published reports give; run python -m lab.findings")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
