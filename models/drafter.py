"""The drafter interface: what the stages, benchmarks and the decoding loop need from any drafter.

A drafter kind is one package in models/ exporting a `models.kind.KindSpec` (its settings
model, its drafter class, its capabilities); `models.drafters` builds the registry from the
specs and saves / loads any drafter with its kind recorded. Nothing outside models/ names a
kind's classes.

The interface is split by role, and a kind implements the roles it has:
  - `Drafter` (every kind): building (`new` for a target and its frozen draft vocabulary,
    `from_tensors` / `tensors` for checkpoints, never the target's own weights, `untrained` for
    evaluate's contrast) and proposing (`proposer`: drafts for the one decoding loop,
    `models.decoding`, with its own cache);
  - `TrainableDrafter`: `replay` (drafts from logged positions of a finished sequence: score's
    replays), `unroll` (the training forward over cached features, optionally along replayed
    drafts; `training_module` wraps it for DDP), `sft_loss` and `acceptance` (the warm-up and
    its teacher-forced acceptance), `replay_logits` / `rollout_ce_loss` (Draft-OPD: the
    drafter along scored replays, for `models.losses.replay_loss`, and its CE anchor);
  - `ServableDrafter`: `write_export` (the directories vLLM loads, written through
    `models.export`), `read_export` (one read back), `served_tokens` and `probe_logits`
    (logits on a fixed input: the export round trip compares them).
Every method that reads the target's states takes one `models.features.Features` record, so a
kind reading another of its fields changes no caller.

Proposals. Per verify step a proposer returns a `Proposal`: N drafted nodes per batch row. A
chain (or a block drafted in one forward) is the proposal whose node i continues node i-1; a
tree gives each node its parent. The loop verifies every shape in one target forward and
accepts losslessly (see models/verify.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import Tensor, nn

from models.acceptance import AcceptanceStats
from models.export_format import ExportError
from models.features import Features
from models.vocab import DraftVocab

if TYPE_CHECKING:
    from models.kind import KindSpec, Reads


@dataclass(frozen=True)
class ChainShape:
    """K drafts per verify step, each continuing the one before (chains, blocks)."""

    k: int
    stop_confidence: float = 0.0
    """Propose only the drafts whose joint confidence reaches it (`confident_length`); 0: all
    K. Lossless: it changes only what is proposed, never how verification accepts."""

    @property
    def depth(self) -> int:
        return self.k


@dataclass(frozen=True)
class TreeShape:
    """An EAGLE-2 dynamic draft tree (see models/chain_propose.py)."""

    depth: int
    top_k: int
    budget: int
    min_confidence: float = 0.0
    """Stop expanding once no frontier node's joint drafter probability reaches it (0: always
    `depth` levels, as EAGLE-2); saves drafter forwards the verifier would rarely accept."""


Shape = ChainShape | TreeShape


@dataclass
class Proposal:
    """One verify step's drafts, N nodes per batch row (nodes past a row's budget are ignored).

    A chain leaves `parent`/`depth` None: node i (0-based) sits at depth i+1 and continues node i-1.
    """

    tokens: Tensor  # [B, N] target ids
    q: Tensor  # [B, N] the drafter's probability of each token at the temperature (1 at T=0)
    confidence: Tensor  # [B, N] max_v q_v where the node was drafted (q at T, or at 1 when T=0)
    forwards: int  # drafter forwards spent
    dists: list[Tensor] | None = None
    """Chains at T>0: per node the drafter's distribution it was sampled from, [B, Vd] each
    (the residual on a rejection needs it). None: each node is a point-mass proposal, q = 1
    at its token (trees; a chain of looked-up tokens), whose rejection removes it from p."""
    vocab_map: Tensor | None = None  # [Vd] target id of each `dists` entry
    parent: Tensor | None = None  # [B, N] trees: the parent's node index (1-based; 0 = the root)
    depth: Tensor | None = None  # [B, N] trees: 1-based depth
    lengths: Tensor | None = None
    """Chains: [B] nodes each row proposes (a lookup finds fewer, or none, for some rows);
    None: all N, up to the row's budget."""
    joint_confidence: bool = True
    """How a chain's stop rule reads `confidence`: True, each node's is conditional on the drafts
    before it (a chain drafted node by node), so their product is the proposal's probability;
    False, a block's positions come from one forward as marginals, so each stands alone."""

    @property
    def is_chain(self) -> bool:
        return self.parent is None

    @classmethod
    def empty(cls, batch: int, device: torch.device, chain: bool) -> Proposal:
        none = torch.zeros(batch, 0, device=device)
        tree = {} if chain else {"parent": none.long(), "depth": none.long()}
        return cls(none.long(), none, none, forwards=0, **tree)


def confident_length(confidence: Tensor, threshold: float, *, joint: bool = True) -> Tensor:
    """Drafts worth proposing per row: the nodes before the first whose confidence (the running
    product along the chain when `joint`) falls below `threshold`. confidence [B, N] -> [B].

    Confidence is the drafter's max_v q_v, known before the node's token is drawn, so stopping
    on it never depends on the token itself: the proposal's law at each kept node is still q,
    and the loop's acceptance stays lossless."""
    score = confidence.cumprod(dim=1) if joint else confidence
    return (score >= threshold).long().cumprod(dim=1).sum(dim=1)


def truncated(proposal: Proposal, keep: Tensor) -> Proposal:
    """A chain proposal cut to its longest row's `keep` [B] nodes (rows past their own keep are
    the caller's to mask out): a shorter verify forward when every row stopped early."""
    n = int(keep.max()) if keep.numel() else 0
    if n == proposal.tokens.shape[1]:
        return proposal
    return replace(
        proposal,
        tokens=proposal.tokens[:, :n],
        q=proposal.q[:, :n],
        confidence=proposal.confidence[:, :n],
        dists=None if proposal.dists is None else proposal.dists[:n],
    )


class Proposer(Protocol):
    """A drafter's state during one decoding call: its cache and the rows it has seen."""

    def propose(self, rows: Features, budget: Tensor) -> Proposal:
        """Read `rows` (committed since the last call, in the committed-rows convention of
        `models.features`; the prompts at the first) and draft up to budget [B] nodes deep per
        row (max(budget) >= 1)."""
        ...

    def keep_rows(self, rows: Tensor) -> None:
        """Finished sequences left the batch: keep batch rows `rows` [B']."""
        ...


@dataclass
class Replayed:
    """K drafts from each of C anchors of one sequence (see `Drafter.replay`)."""

    tokens: Tensor  # [C, K] int64 target ids
    logq: Tensor  # [C, K] fp32 log q(token) at the temperature; 0 at T=0 (q is one-hot)
    confidence: Tensor  # [C, K] fp32 max_v q_v, q at the temperature (at 1 when T = 0)


class Drafter(nn.Module, ABC):
    """Base class of every drafter kind: building and proposing, what even a decode-only kind
    has. Training (`TrainableDrafter`) and serving (`ServableDrafter`) are roles a kind adds;
    a stage that needs one checks it with `require`."""

    spec: ClassVar[KindSpec]  # the kind's spec (set by it: models.kind.KindSpec)
    config_type: ClassVar[Any]  # the kind's frozen config dataclass (a `KindConfig`)
    config: Any  # this drafter's, a `config_type`

    @property
    def kind(self) -> str:
        return self.spec.name

    @property
    def drafts_blocks(self) -> bool:
        return self.spec.drafts_blocks

    # -- building -------------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def new(cls, target: Any, vocab: DraftVocab, settings: Mapping[str, Any]) -> Drafter:
        """A freshly initialised drafter for `target` (seed torch's RNG first); `settings` are
        the kind's own options (`KindSettings.settings()`)."""

    @classmethod
    def check_settings(cls, settings: Mapping[str, Any], target: Any) -> None:
        """Refuse settings `new` could not build a drafter of for `target` (ValueError naming
        the setting), without allocating one: callers run it before any work. It builds the
        config alone, at the target's vocab size: the draft vocab's size is no setting (the
        features' map gives it), and every rule accepts the target's."""
        cls.config_for(target, target.vocab_size, settings)

    @classmethod
    @abstractmethod
    def config_for(cls, target: Any, draft_vocab_size: int, settings: Mapping[str, Any]) -> Any:
        """The config `new` builds for `target`, a draft vocab of `draft_vocab_size` ids and
        the kind's `settings`; a ValueError names a setting it cannot build (a kind without
        settings accepts none: its settings model refuses them)."""

    @classmethod
    def settings_of(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """The settings a saved drafter config (`config.to_dict()`) was built with, by setting
        name: what continuing that drafter must not contradict (its architecture is fixed)."""
        return cls.spec.settings.recorded(config)

    @property
    def reads(self) -> Reads:
        """What this drafter reads of the target's states: its kind's, at its settings."""
        return self.spec.settings_of(self.settings_of(self.config.to_dict())).reads()

    @classmethod
    def from_tensors(
        cls,
        config: Mapping[str, Any],
        embed_weight: Tensor | None,
        tensors: Mapping[str, Tensor],
        source: str,
    ) -> Drafter:
        """A drafter from a checkpoint's config (read as the kind's `config_type`) and tensors
        (beside the target's embedding, None for a kind that reads none); refuses missing,
        unexpected or misshapen tensors by name (`source` names the checkpoint in errors)."""
        return cls.from_config(cls.config_type.from_dict(config), embed_weight, tensors, source)

    @classmethod
    @abstractmethod
    def from_config(
        cls, config: Any, embed_weight: Tensor | None, tensors: Mapping[str, Tensor], source: str
    ) -> Drafter:
        """`from_tensors` once the checkpoint's config is read back."""

    @abstractmethod
    def tensors(self) -> dict[str, Tensor]:
        """Everything a checkpoint holds: trained weights and buffers, never the target's."""

    @abstractmethod
    def untrained(self) -> Drafter:
        """A drafter of the same config with fresh weights (seed torch's RNG first)."""

    def rebuilt(self, tensors: Mapping[str, Tensor], source: str) -> Drafter:
        """This drafter's kind and config with other tensors (e.g. gathered from FSDP shards)."""
        embed = self.frozen_embedding()
        device = next(self.parameters()).device if embed is None else embed.device
        return type(self).from_config(self.config, embed, tensors, source).to(device)

    def frozen_embedding(self) -> Tensor | None:
        """The target's embedding this drafter reads (never trained, never saved); None for a
        kind that reads none (a Medusa head)."""
        return None

    @property
    @abstractmethod
    def vocab(self) -> DraftVocab:
        """The frozen draft vocabulary of the features it was trained on."""

    @abstractmethod
    def check_target(self, target: Any) -> None:
        """Refuse a target this drafter was not built for: it would run and accept nothing."""

    # -- decoding -------------------------------------------------------------------------

    @abstractmethod
    def proposer(
        self, shape: Shape, temperature: float, generator: torch.Generator, timer: Any
    ) -> Proposer:
        """A fresh proposer for one decoding call; `timer("drafter")` wraps its forwards."""


def require(drafter: Drafter | type[Drafter], role: type[Drafter], use: str) -> None:
    """Refuse, with one line, a kind that lacks the role `use` needs (TrainableDrafter,
    ServableDrafter)."""
    cls = drafter if isinstance(drafter, type) else type(drafter)
    if not issubclass(cls, role):
        raise ValueError(f"a {cls.spec.name} drafter cannot {use} (it is no {role.__name__})")


class TrainableDrafter(Drafter):
    """The training role: SFT's and Draft-OPD's forwards and losses over cached features.

    A kind assigns its own functions (their first argument the drafter) rather than restating
    these signatures."""

    @abstractmethod
    def replay(
        self,
        features: Features,
        anchors: Tensor,
        k: int,
        *,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> Replayed:
        """Draft K tokens from each anchor e of one finished sequence, as the decoding loop
        would from the prefix y<e. features: one sequence ([T] ids, [T, F] aux; the sequence
        convention of `models.features`), anchors [C] (repeat one for several samples); T=0
        drafts the argmax, T>0 samples with `generator`."""

    @abstractmethod
    def unroll(
        self,
        features: Features,
        loss_mask: Tensor | None,
        steps: int,
        replays: tuple[Tensor, Tensor, Tensor] | None = None,
    ) -> Any:
        """The training forward over a batch of sequences: features (the sequence convention
        of `models.features`, [B, T]), loss_mask [B, T] (positions trained on), `steps` draft
        offsets. With replays (item [N], anchor [N], tokens [N, K]: the drafts a decoder made
        from the prefix y<anchor of batch row item) the outputs also cover those drafts. The
        result is what `sft_loss`, `acceptance`, `replay_logits` and `rollout_ce_loss` read."""

    def training_module(self) -> nn.Module:
        """`unroll` as one module, so DDP sees one forward per backward:
        forward(*unrolls) -> [unroll(*u) for u in unrolls]."""
        return Unrolls(self)

    @abstractmethod
    def sft_loss(
        self, out: Any, teacher: Tensor, last_hidden: Tensor, *, decay: float, objective: str | None
    ) -> Tensor:
        """The warm-up loss of a teacher-forced unroll; teacher [B, T, Vd] is the target's
        distribution at every position, last_hidden [B, T, H] its post-norm state; `decay`
        weighs later draft offsets; `objective` picks one of the spec's `objectives`."""

    @abstractmethod
    def acceptance(
        self, out: Any, target_logits: Tensor, *, chain_k: int, expected: bool = True
    ) -> AcceptanceStats:
        """Teacher-forced acceptance per draft offset of an unroll (tau over the first chain_k
        offsets); target_logits [B, T, V] at every position."""

    @abstractmethod
    def replay_logits(self, out: Any, item: Tensor, anchor: Tensor, *, lazy: bool = False) -> Any:
        """The drafter's logits [N, K, Vd] along each replay of an unroll given replays; with
        `lazy` they may be a `models.head_loss.HeadLogits` or `HeadSlots` (the losses read
        them fused)."""

    @abstractmethod
    def rollout_ce_loss(
        self, out: Any, teacher: Tensor, item: Tensor, anchor: Tensor, decay: float
    ) -> Tensor:
        """The warm-up loss on the teacher-forced part of an unroll given replays (the rollout
        sequences' own rows: Draft-OPD's CE anchor at no extra forward)."""


class Unrolls(nn.Module):
    """Several `unroll`s (a Draft-OPD step's replays and its CE anchor's batch) as one forward.
    Each unroll is (features, loss_mask, replays or None, steps)."""

    def __init__(self, drafter: TrainableDrafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, *unrolls: tuple) -> list[Any]:
        return [
            self.drafter.unroll(features, mask, steps, replays)
            for features, mask, replays, steps in unrolls
        ]


@dataclass(frozen=True)
class ExportTarget:
    """What an export records about the target it serves beside."""

    config: Any  # the target's HF config
    identity: Mapping[str, Any] | None  # its identity (provenance)
    embed_weight: Tensor  # its embedding [V, H]


class ServableDrafter(Drafter):
    """The serving role: the directories vLLM loads (the spec's `export_formats`, served with
    its `serve_method`), read back and compared by `probe_logits`."""

    @abstractmethod
    def write_export(
        self, fmt: str, out_dir: Path, target: ExportTarget, *, k: int, verifier: str | None
    ) -> Path:
        """Write this drafter as `fmt` (one of the spec's `export_formats`) into `out_dir` to
        serve `k` speculative tokens, refusing (`models.export.ExportError`) what vLLM would
        load but serve wrongly."""

    def speculative_config(self, export_dir: Path, k: int) -> dict[str, Any]:
        """vLLM's `--speculative-config` serving this drafter's export in `export_dir` with
        `k` drafted tokens asked for."""
        return {
            "method": self.spec.serve_method,
            "model": str(export_dir.resolve()),
            "num_speculative_tokens": self.served_tokens(k),
        }

    def served_tokens(self, k: int) -> int:
        """`num_speculative_tokens` vLLM must serve this drafter with, given the K asked for
        (a chain serves any K; a block drafter, its block)."""
        return k

    @classmethod
    @abstractmethod
    def read_export(cls, export_dir: Path, embed_weight: Tensor | None) -> Drafter:
        """The drafter an export of this kind holds; refuses a corrupted export by name."""

    @classmethod
    def from_export(
        cls, export_dir: Path, config: Any, embed: Tensor | None, tensors: Mapping[str, Tensor]
    ) -> Drafter:
        """`from_config` on what an export holds (`config` the kind's config read from it), a
        misfit refused as the `ExportError` it is."""
        try:
            return cls.from_config(config, embed, tensors, str(export_dir))
        except ValueError as err:  # a tensor set or shape that does not fit the config
            raise ExportError(str(err)) from None

    @abstractmethod
    def probe_logits(self, seed: int) -> Tensor:
        """Logits on a small input drawn from `seed` and the config alone (the same for every
        drafter of one config), so an export's round trip compares like with like."""


def check_tensor_set(
    expected: Mapping[str, Tensor], tensors: Mapping[str, Tensor], source: str
) -> None:
    """Refuse a checkpoint's `tensors` that are missing, unexpected or misshapen against a
    freshly built drafter's (`expected`), by name (`source` names the checkpoint)."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{source}: missing tensors {missing}, unexpected tensors {unexpected}")
    for name, t in tensors.items():
        if t.shape != expected[name].shape:
            raise ValueError(
                f"{source}: tensor {name!r} has shape {tuple(t.shape)}, expected "
                f"{tuple(expected[name].shape)}"
            )


def check_matches_target(
    drafter: Any,
    target: Any,
    more: Sequence[tuple[str, Any, Any]] = (),
    fix: str = "use the drafter trained for this target",
) -> None:
    """Refuse a target whose vocab or hidden size differs from the drafter's config, or from
    the vocab map it holds, or that differs in any of `more` (name, the drafter's, the
    target's), naming the first; `fix` says what to do."""
    cfg = drafter.config
    pairs = [
        ("vocab size", cfg.vocab_size, target.vocab_size),
        ("vocab map (t2d) size", drafter.t2d.numel(), target.vocab_size),
        ("hidden size", cfg.hidden_size, target.hidden_size),
        *more,
    ]
    for name, theirs, ours in pairs:
        if theirs != ours:
            raise ValueError(
                f"drafter does not match the target: drafter {name} is {theirs}, target's "
                f"is {ours}; {fix}"
            )


def check_trained_for(embed_weight: Tensor, config: Any, source: str) -> None:
    """Refuse loading `source` beside an embedding not [config.vocab_size, config.hidden_size]."""
    if tuple(embed_weight.shape) != (config.vocab_size, config.hidden_size):
        raise ValueError(
            f"{source} was trained for a target with vocab {config.vocab_size} and hidden size "
            f"{config.hidden_size}, but the given embedding is {tuple(embed_weight.shape)}: load "
            "it with the target it was trained for"
        )


def without_embedding(module: nn.Module) -> dict[str, Tensor]:
    """`module`'s weights and buffers but the target's `embed_tokens` (never saved)."""
    return {
        name: t.detach().contiguous()
        for name, t in module.state_dict().items()
        if not name.startswith("embed_tokens.")
    }


def weights_dtype(tensors: Mapping[str, Tensor], source: str) -> torch.dtype:
    """The one floating dtype a checkpoint's weights were saved in (the vocab map's integer
    and bool buffers aside); refuses a mix, which no drafter saves."""
    found = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(found) != 1:
        raise ValueError(
            f"{source}: the weights hold {len(found)} floating dtypes "
            f"({', '.join(sorted(str(d) for d in found))}), a drafter saves one; restore it"
        )
    return found.pop()


class FrozenEmbeddingDrafter(Drafter):
    """What the kinds built on the target's own embedding share (EAGLE-3, DFlash, MTP): the
    module reads the target's frozen `embed_tokens` (never trained, never saved), carries the
    draft-vocab map as `d2t` / `t2d` buffers, runs beside that embedding, is built as
    `cls(config, embed_weight, vocab)` (a kind built otherwise overrides `built_for` and
    `untrained`)."""

    embed_tokens: nn.Embedding

    @classmethod
    def from_config(
        cls, config: Any, embed_weight: Tensor, tensors: Mapping[str, Tensor], source: str
    ) -> Drafter:
        check_trained_for(embed_weight, config, source)
        drafter = cls.built_for(config, embed_weight, tensors, source)
        check_tensor_set(drafter.tensors(), tensors, source)
        # on the embedding's device: the drafter runs beside the target whose embedding it shares
        drafter.to(device=embed_weight.device, dtype=weights_dtype(tensors, source))
        # `.to()` may have cast the shared embedding; re-attach the target's own tensor.
        drafter.embed_tokens.weight = nn.Parameter(embed_weight, requires_grad=False)
        drafter.load_state_dict(tensors, strict=False)
        return drafter

    @classmethod
    def built_for(
        cls, config: Any, embed_weight: Tensor, tensors: Mapping[str, Tensor], source: str
    ) -> Drafter:
        """A fresh drafter of `config` for `tensors` to load into, built from what of them its
        constructor takes (the draft vocab map)."""
        for name in ("d2t", "t2d"):
            if name not in tensors:
                raise ValueError(
                    f"{source}: tensor {name!r} is missing; the draft vocab map cannot be rebuilt"
                )
        return cls(config, embed_weight, DraftVocab(tensors["d2t"], tensors["t2d"]))

    def tensors(self) -> dict[str, Tensor]:
        return without_embedding(self)

    def untrained(self) -> Drafter:
        fresh = type(self)(self.config, self.embed_tokens.weight, self.vocab)
        return fresh.to(self.embed_tokens.weight.device)  # where this one runs

    def frozen_embedding(self) -> Tensor:
        return self.embed_tokens.weight

    def check_embedding(self, target: Any) -> None:
        """Refuse an embedding that is not the target's (the drafter would read other tokens)."""
        embed, ours = self.embed_tokens.weight, target.embed_weight
        if embed.data_ptr() != ours.data_ptr() and not torch.equal(
            embed.to(ours.device, ours.dtype), ours
        ):
            raise ValueError(
                "the drafter's embed_tokens is not the target's embedding; build or load the "
                "drafter with target.embed_weight"
            )
