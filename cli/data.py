"""`opd ls`, `opd show`, `opd gc`: what the data root holds; `opd data`: trajectories and
drafters in and out of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from storage import Store


def _human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError


@click.command("ls")
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_obj
def ls_cmd(store: Store, name: str | None, as_json: bool) -> None:
    """List datasets and their versions (complete or not, rows, bytes)."""
    rows = store.listing(name)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo(f"no datasets under {store.root}")
        return
    click.echo(f"{'dataset':<28} {'state':<10} {'rows':>8} {'bytes':>10}  created")
    for r in rows:
        ref = f"{r['name']}@{r['version']}" + (" *" if r["latest"] else "")
        state = "INVALID" if r["invalid"] else "complete" if r["complete"] else "INCOMPLETE"
        rows_s = "-" if r["rows"] is None else str(r["rows"])
        click.echo(
            f"{ref:<28} {state:<10} {rows_s:>8} {_human_bytes(r['bytes']):>10}  {r['created'] or '-'}"
        )
    click.echo("(* = latest)")
    for r in rows:
        if r["invalid"]:
            click.echo(f"INVALID {r['name']}@{r['version']}: {r['invalid']}")


def _print_tree(node: dict[str, Any], indent: str = "", role: str = "") -> None:
    label = f"{role}: " if role else ""
    extra = " (missing)" if node.get("missing") else f"  [{node.get('stage')}]"
    click.echo(f"{indent}{label}{node['ref']}{extra}")
    if (source := node.get("source")) is not None:
        click.echo(f"{indent}  source: {source.get('file')} (sha256 {source['sha256']})")
    for r, child in node.get("inputs", {}).items():
        _print_tree(child, indent + "  ", r)


@click.command("show")
@click.argument("ref")
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
@click.option("--verify", is_flag=True, help="Checksum every shard now.")
@click.pass_obj
def show_cmd(store: Store, ref: str, as_json: bool, verify: bool) -> None:
    """Show a dataset's manifest and its lineage back to the prompts."""
    ds = store.open(ref)
    if verify:
        ds.verify_all(rehash=True)
    if as_json:
        click.echo(json.dumps(ds.manifest | {"lineage": store.lineage(ds.ref)}, indent=2))
        return
    m = ds.manifest
    prov = m["provenance"]
    git = prov["git"]
    click.echo(f"{ds.ref}  stage={m['stage']} v{m['stage_version']}")
    click.echo(f"  path:      {ds.path}")
    click.echo(f"  rows:      {m['rows']}   bytes: {_human_bytes(m['bytes'])}")
    click.echo(f"  shards:    {len(m['shards'])}" + ("  (all verified)" if verify else ""))
    click.echo(f"  created:   {prov['committed_at']}   by: {' '.join(prov['command'])}")
    dirty = " (dirty)" if git.get("dirty") else ""
    click.echo(f"  code:      {git.get('sha') or 'not a git checkout'}{dirty}")
    click.echo("  config:    " + json.dumps(m["config"], sort_keys=True))
    if m.get("meta"):
        click.echo("  meta:      " + json.dumps(m["meta"], sort_keys=True)[:2000])
    click.echo("lineage:")
    _print_tree(store.lineage(ds.ref), "  ")


@click.command("gc")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@click.pass_obj
def gc_cmd(store: Store, dry_run: bool) -> None:
    """Remove incomplete datasets and stale temporaries (never a complete dataset), and what
    killed exports left under <root>/_exports."""
    from pipeline.core.export import tidy_exports

    removed = store.gc(dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    for p in removed:
        click.echo(f"{verb} {p}")
    exports = tidy_exports(store.root, dry_run=dry_run)
    for action in exports:
        click.echo(f"would be {action}" if dry_run else action)
    click.echo(
        f"{verb} {len(removed)} path(s)"
        + (f"; {len(exports)} export leftover(s)" if exports else "")
    )


@click.group("data")
def data_group() -> None:
    """Data in and out of the data root: trajectories as one file, drafters from a directory."""


@data_group.command("export")
@click.argument("ref", default="trajectories@latest")
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    required=True,
    help="The Parquet file to write (new): the dataset's columns, the target's tokenizer "
    "fingerprint and what made the rows in its metadata.",
)
@click.pass_obj
def data_export_cmd(store: Store, ref: str, out: Path) -> None:
    """Write a trajectories dataset as one Parquet file that `opd data import` (or
    generate.source) reads into another data root."""
    from cli.common import command_config, command_target
    from pipeline.core.trajectory_files import export_trajectories

    ds = store.open(ref)
    _, loader = command_target(command_config(None, ()), None, (), [ds])
    meta = export_trajectories(ds, loader, out, store.lineage(ds.ref))
    click.echo(
        f"wrote {out}: {meta['rows']} trajectories of {ds.ref}, {_human_bytes(meta['bytes'])}"
    )
    click.echo(f"  sha256 {meta['sha256']}")


@data_group.command("import")
@click.argument("file", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option(
    "--profile",
    default=None,
    help="Config profile naming the target [default: the "
    "target the file records (Parquet); chat JSONL needs one or --set target.path].",
)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE")
@click.pass_obj
def data_import_cmd(store: Store, file: Path, profile: str | None, sets: tuple[str, ...]) -> None:
    """Import a trajectories file (an `opd data export` Parquet file, or chat JSONL) as a
    `trajectories` version: the generate stage with generate.source=FILE."""
    from cli.common import recorded_target, setup_logging
    from pipeline.core.runner import RunContext, run_stage
    from pipeline.core.targets import TargetLoader
    from pipeline.core.trajectory_files import file_info
    from pipeline.profiles import load_config
    from pipeline.stages import generate

    cfg = load_config(profile or "default", None, list(sets))
    spec = {k: v for k, v in (file_info(file).meta.get("target") or {}).items() if k != "dtype"}
    target = recorded_target(spec, profile, sets, str(file))
    section = cfg.generate.model_copy(update={"source": str(file.expanduser().resolve())})
    setup_logging()
    ctx = RunContext(store=store, target_loader=TargetLoader(target), progress=False)
    res = run_stage(generate.STAGE, section, {}, ctx)
    click.echo(f"{res.ref}" + ("  (existed)" if res.reused else f"  ({res.seconds:.1f}s)"))


@data_group.command("import-drafter")
@click.argument("directory", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option(
    "--profile",
    default=None,
    help="Config profile naming the target [default: the target the directory records].",
)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE")
@click.pass_obj
def import_drafter_cmd(
    store: Store, directory: Path, profile: str | None, sets: tuple[str, ...]
) -> None:
    """Import a drafter directory (an `opd export` directory, or a drafter dataset copied out of
    a data root) as an `sft` version that eval, tune, rollout, export, sft and opd read."""
    from cli.common import recorded_target
    from pipeline.core.drafter_import import describe, import_drafter
    from pipeline.core.drafter_import import recorded_target as drafter_target
    from pipeline.core.targets import TargetLoader

    target = recorded_target(drafter_target(describe(directory)), profile, sets, str(directory))
    ds, existed = import_drafter(store, directory, TargetLoader(target))
    click.echo(f"{ds.ref}" + ("  (existed)" if existed else ""))
