"""The stage record: what a stage is, declared once, next to its code.

Every stage module ends with `STAGE = Stage(...)`; `pipeline.stages.STAGES` lists them in
pipeline order, and everything that needs to know about stages derives from that list: the
dataset names the store accepts, the config sections of `PipelineConfig`, the chains, the
CLI's help and defaults, and the check that every input is the kind of dataset its role reads.
Adding a stage is its module plus one line in `pipeline/stages.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.core.config import StrictConfig
from storage import Dataset, OpdError

Inputs = dict[str, Dataset]
"""The datasets a stage's `run(cfg, inputs, output, rank, world_size, ctx)` reads, by role."""

DRAFTER_DATASETS = ("sft", "opd")
"""Dataset names that hold a trained drafter (what a `drafter` role reads)."""


HELDOUT_SETS = "heldout_sets"
"""A prompts dataset's manifest meta key: the held-out benchmark sets it holds, in order; a
held-out row's `source` is SET:ID (evaluate measures each set)."""


@dataclass(frozen=True)
class Stage:
    name: str
    """CLI name, step key and config section (`opd run NAME`, `--set NAME.key=value`)."""
    output: str
    """The dataset it writes (`<root>/<output>/<version>/`)."""
    version: str
    """Bump when the code's output changes for the same config: it is part of the version."""
    config: type[StrictConfig]
    run: Callable[..., dict]
    """run(cfg, inputs, output, rank, world_size, ctx) -> manifest meta; writes the shards."""
    doc: str
    """One line for `opd run --help`."""
    inputs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Role -> the dataset names (producing stages' outputs) that role accepts."""
    optional_inputs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    default_inputs: Mapping[str, str] = field(default_factory=dict)
    """Role -> the ref a single-stage run reads when `--input` does not name one
    (default: `<role's first kind>@latest`)."""
    repeated_role: str | None = None
    """A role that may also come as ROLE-2, ROLE-3, ... (analyze compares several logs)."""
    uses_target: bool = True
    """The target's identity is part of the version (it is loaded only when the stage needs it)."""
    sharded: bool = False
    """Work is split into shards by rank (generate, features, rollout, score, evaluate);
    otherwise rank 0 writes (and training stages run DDP or FSDP)."""
    ddp: bool = False
    """Every rank trains (DistributedDataParallel) and rank 0 writes: under torchrun all ranks
    run it; a stage that is neither sharded nor ddp runs on rank 0 alone."""
    per_round: bool = False
    """Repeated once per Draft-OPD round as `<name>-r<round>`; its config has a `round` field."""
    may_be_empty: bool = False
    """Committing 0 rows from non-empty inputs is legitimate (otherwise it is an error)."""
    drafting: Mapping[str, str] = field(default_factory=dict)
    """Config fields tied to the pipeline's `drafting` section: field -> drafting field. Users
    set `drafting.k` once; each stage's version holds only the K-values it uses."""
    precheck: Callable[[Any, Mapping[str, Dataset], Any], None] | None = None
    """precheck(cfg, inputs, ctx): cheap checks that the inputs belong together (target,
    lineage), run before the output's directory exists, so a refused run leaves nothing."""
    version_extra: Callable[[Any], dict] | None = None
    """Extra data hashed into the version (e.g. a source file's content hash)."""
    version_config: Callable[[Any], dict] | None = None
    """The config as the version records it, where that is not `version_dict(cfg)`: e.g. input
    files by name when `version_extra` already hashes their content."""
    resolve: Callable[[Any, Any], Any] | None = None
    """resolve(cfg, ctx) -> cfg with its machine-dependent `auto` settings made concrete (a
    training stage's `bf16`), before the version is computed and the stage runs: the version
    records what this machine does, not what the user left to it."""
    unread_inputs: Callable[[Any], tuple[str, ...]] | None = None
    """unread_inputs(cfg): required roles this config does not read (generate with a `source`
    file reads no prompts); they are then neither required nor accepted."""
    engine: Callable[[Any, Any], str | None] | None = None
    """engine(cfg, ctx): what a `backend: auto` setting resolves to on this machine; it is
    hashed into the version, since different engines write different (equally valid) tokens."""

    def input_kinds(self, role: str) -> tuple[str, ...] | None:
        """The dataset names `role` accepts; None if the stage has no such role."""
        known = {**self.inputs, **self.optional_inputs}
        if role in known:
            return known[role]
        base, _, n = role.rpartition("-")
        if self.repeated_role and base == self.repeated_role and n.isdigit() and int(n) >= 2:
            return known[base]
        return None

    def default_ref(self, role: str) -> str:
        return self.default_inputs.get(role) or f"{self.input_kinds(role)[0]}@latest"

    def required_roles(self, cfg: Any = None) -> list[str]:
        """The roles `cfg` makes this stage read (all of `inputs` unless `unread_inputs`)."""
        unread = self.unread_inputs(cfg) if self.unread_inputs and cfg is not None else ()
        return [r for r in self.inputs if r not in unread]

    def check_inputs(self, inputs: Mapping[str, Dataset], cfg: Any = None) -> None:
        """Every required role is given, and every given dataset is a kind its role reads."""
        required = self.required_roles(cfg)
        missing = sorted(set(required) - set(inputs))
        if missing:
            raise OpdError(f"stage {self.name} needs inputs {missing}")
        if unread := sorted((set(self.inputs) - set(required)) & set(inputs)):
            raise OpdError(
                f"stage {self.name} does not read {unread} with this config (e.g. "
                f"{self.name}.source set): drop --input {unread[0]}"
            )
        for role, ds in inputs.items():
            kinds = self.input_kinds(role)
            if kinds is None:
                roles = [*self.inputs, *self.optional_inputs]
                raise OpdError(f"stage {self.name} has no input role {role!r}; roles: {roles}")
            if ds.ref.name not in kinds:
                raise OpdError(
                    f"stage {self.name} reads {role!r} from a {' or '.join(kinds)} dataset, but "
                    f"{ds.ref} is a {ds.ref.name} dataset: pass --input {role}="
                    f"{kinds[0]}@VERSION (or {kinds[0]}@latest)"
                )
