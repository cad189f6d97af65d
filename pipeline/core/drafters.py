"""Drafter datasets (`sft`, `opd`): their layout, writing one, and loading one for its target.

Layout: `model.safetensors` + `drafter_config.json` (the drafter), `draft_vocab.safetensors`
(the frozen map, byte for byte as the features stage wrote it), `metrics.parquet` (one `train`
row per step, one `val` row per validation) and `summary.json` (the manifest's meta).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
from torch import nn

from models.drafter import Drafter, TrainableDrafter
from models.drafters import (
    CONFIG_FILE,
    KINDS,
    WEIGHTS_FILE,
    drafter_class,
    load_drafter,
    recorded_kind,
    recorded_settings,
    save_drafter,
)
from models.kind import KindSpec
from models.target import Target
from pipeline.core.checks import VOCAB_FILE, check_same_target
from pipeline.core.config import DrafterConfig
from pipeline.core.stage import DRAFTER_DATASETS
from storage import Dataset, DatasetWriter, OpdError

METRICS_FILE = "metrics.parquet"
SUMMARY_FILE = "summary.json"
OUTPUT_FILES = (WEIGHTS_FILE, CONFIG_FILE, VOCAB_FILE, METRICS_FILE, SUMMARY_FILE)


def drafter_kind(ds: Dataset) -> str:
    """The kind of the drafter in `ds` (refusing a dataset that holds no drafter)."""
    if ds.ref.name not in DRAFTER_DATASETS:
        raise OpdError(f"{ds.ref} is not a drafter; pass an sft or opd dataset (e.g. sft@latest)")
    return recorded_kind(ds.path)


def needs_training(kind: str) -> bool:
    """Whether drafters of `kind` learn (a `TrainableDrafter`). One that does not (prompt
    lookup) reads no features: the sft chain featurizes nothing for it and `sft` writes its
    dataset untrained, and Draft-OPD refuses it (`refuse_untrained`)."""
    return issubclass(drafter_class(kind), TrainableDrafter)


def baseline_kind() -> KindSpec | None:
    """The registry's training-free baseline (`KindSpec.baseline`: prompt lookup), which every
    evaluation also measures; None when no kind is one."""
    return next((spec for spec in KINDS.values() if spec.baseline), None)


def refuse_untrained(kind: str, what: str) -> None:
    """One line refusing a kind that needs no training where `what` (a Draft-OPD stage or
    chain) would train it."""
    if not needs_training(kind):
        raise OpdError(
            f"a {kind} drafter needs no training, so {what} has nothing to train: evaluate or "
            "roll it out (opd run sft-chain, opd eval, opd run rollout), or set drafter.kind to "
            "a kind that trains"
        )


def check_continued_drafter(ds: Dataset, wanted: DrafterConfig) -> None:
    """Refuse, before any work, to continue the drafter in `ds` as another kind, or with a
    setting other than the one it was built with: its architecture is its checkpoint's, so the
    setting would be recorded in the new dataset's config but not trained."""
    kind = drafter_kind(ds)
    if kind != wanted.kind:
        raise OpdError(
            f"{ds.ref} holds a {kind} drafter, but drafter.kind is {wanted.kind}: pass "
            f"--set drafter.kind={kind} to continue it, or drop --input drafter to train a fresh "
            f"{wanted.kind} drafter"
        )
    recorded = recorded_settings(ds.path)
    for name, value in wanted.settings().items():
        if recorded.get(name) != value:
            raise OpdError(
                f"drafter.{name}={value} but the continued drafter {ds.ref} has "
                f"{recorded.get(name)} (a continued drafter keeps the settings it was built "
                "with): drop the setting or train a fresh drafter (leave out --input drafter)"
            )


def check_drafter_settings(drafter: DrafterConfig, target: Target) -> None:
    """Refuse, before any work, settings a fresh drafter of the configured kind cannot take
    for `target` (e.g. a DFlash block longer than the target's positions)."""
    try:
        drafter_class(drafter.kind).check_settings(drafter.settings(), target)
    except ValueError as e:
        raise OpdError(
            f"drafter settings do not fit the target: {e}; change that drafter.* setting or "
            "leave it unset (the kind's default)"
        ) from None


def check_reads_recorded_target(drafter: DrafterConfig, aux_count: int, ref: str) -> None:
    """Refuse, before any work, training a fresh drafter on data whose target captured another
    number of aux layers than the configured kind reads (`ref` made them)."""
    wanted = drafter.reads().target_layers
    if wanted and wanted != aux_count:
        raise OpdError(
            f"{ref} holds {aux_count} target layers per position, and the configured {drafter.spec.title} "
            f"drafter reads {wanted}: train a drafter that reads {aux_count} (the kind the data "
            f"was made for), or make the data again for this one (opd run features --set "
            f"drafter.kind={drafter.kind} ...)"
        )


def load_drafter_dataset(
    ds: Dataset, target: Target, identity: dict, *, kind: str | None = None
) -> Drafter:
    """The drafter in `ds`, with the target's embedding re-attached; refuses a foreign target
    (and, with `kind`, a drafter of another kind)."""
    if ds.ref.name not in DRAFTER_DATASETS:
        raise OpdError(f"{ds.ref} is not a drafter; pass an sft or opd dataset (e.g. sft@latest)")
    check_same_target(ds, identity)
    ds.verify_all()
    try:
        drafter = load_drafter(ds.path, target.embed_weight, kind=kind)
    except ValueError as e:
        raise OpdError(f"{ds.ref}: {e}") from None
    return in_target_dtype(drafter, target).eval()


def in_target_dtype(drafter: Drafter, target: Target) -> Drafter:
    """`drafter` with weights stored in a narrower dtype than the target's (an export imported
    in bf16, beside an fp32 target) upcast to it, which is exact: continued training then
    updates fp32 weights, as training from scratch does. Never downcast: a drafter trained in
    fp32 keeps its weights beside a bf16 target."""
    dtype = target.embed_weight.dtype
    own = [p for n, p in drafter.named_parameters() if not n.startswith("embed_tokens.")]
    narrower = [p for p in own if p.is_floating_point() and p.dtype.itemsize < dtype.itemsize]
    if not narrower:
        return drafter
    drafter.to(dtype=dtype)
    # `.to()` casts the shared embedding's parameter too: re-attach the target's own tensor
    drafter.embed_tokens.weight = nn.Parameter(target.embed_weight, requires_grad=False)
    return drafter


def written_summary(output: DatasetWriter) -> dict[str, Any] | None:
    """The summary of a drafter dataset whose files are all written (only the commit was
    missing when the stage stopped), else None."""
    if all(output.has_shard(f) for f in OUTPUT_FILES):
        return json.loads((output.dir / SUMMARY_FILE).read_text())
    return None


def write_drafter_dataset(
    output: DatasetWriter,
    drafter: Drafter | Dataset,
    vocab_from: Dataset,
    metrics: list[dict[str, Any]],
    schema: pa.Schema,
    summary: dict[str, Any],
) -> dict[str, Any]:
    """Write every file of the layout; `drafter` is a trained module, or a drafter dataset
    whose files are copied byte for byte (a stage that had nothing to train on). The summary
    records the drafter's kind (`drafter_kind`); returns the summary written."""
    if isinstance(drafter, Dataset):
        summary = summary | {"drafter_kind": recorded_kind(drafter.path)}
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            output.write_file(name, drafter.file(name))
    else:
        summary = summary | {"drafter_kind": drafter.kind}
        with tempfile.TemporaryDirectory() as tmp:
            save_drafter(drafter, tmp)
            for name in (WEIGHTS_FILE, CONFIG_FILE):
                output.write_file(name, Path(tmp) / name)
    output.write_file(VOCAB_FILE, vocab_from.file(VOCAB_FILE))
    output.write_parquet(METRICS_FILE, pa.Table.from_pylist(metrics, schema=schema))
    output.write_bytes(SUMMARY_FILE, json.dumps(summary, indent=2, sort_keys=True).encode())
    return summary


def trained_depth(ds: Dataset) -> int | None:
    """The deepest draft offset the drafter in `ds` was trained at: SFT's `ttt_steps` (its
    training-time-test unroll), Draft-OPD's replay depth, the deepest along the drafter's
    lineage; None when no dataset of the lineage records one (or it is not in this store)."""
    depths = []
    if ds.meta.get("untrained"):
        return None  # nothing was trained: it drafts any depth as well as any other
    if ds.ref.name == "sft":
        depths.append(ds.config.get("stage", {}).get("ttt_steps"))
    elif "replays" in ds.inputs:
        try:
            depths.append(ds.store.open(ds.inputs["replays"]).config.get("stage", {}).get("k"))
        except OpdError:
            pass
    if "drafter" in ds.inputs:
        try:
            depths.append(trained_depth(ds.store.open(ds.inputs["drafter"])))
        except OpdError:
            pass
    known = [d for d in depths if isinstance(d, int)]
    return max(known) if known else None


def check_drafting_depth(ds: Dataset, depth: int) -> None:
    """Refuse, before any work, to draft deeper than the drafter was trained: the offsets past
    its training are drafts from inputs it never learned on, accepted rarely and paid for."""
    trained = trained_depth(ds)
    if trained is not None and depth > trained:
        raise OpdError(
            f"drafting depth {depth} exceeds the {trained} steps {ds.ref} was trained to draft "
            f"(sft.ttt_steps): lower drafting.k (or drafting.tree.depth) to at most {trained}, "
            "or train a drafter with a larger drafting.ttt_steps"
        )
