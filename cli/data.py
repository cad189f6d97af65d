"""`opd ls`, `opd show`, `opd gc`: what the data root holds."""

from __future__ import annotations

import json
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
