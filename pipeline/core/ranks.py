"""Ranks: DDP and FSDP helpers that are no-ops in a single process (`torchrun` initialises
torch.distributed)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from storage import OpdError


def distributed() -> bool:
    """Whether torch.distributed is initialised (a `torchrun` launch), i.e. ranks must talk."""
    return dist.is_available() and dist.is_initialized()


def resolve_ranks(rank: int, world_size: int) -> tuple[int, int]:
    """(rank, world_size) of this process, checked against torch.distributed when it is up."""
    if distributed():
        actual = (dist.get_rank(), dist.get_world_size())
        if (rank, world_size) != actual:
            raise OpdError(
                f"the stage was given rank {rank} of {world_size} but torch.distributed says "
                f"rank {actual[0]} of {actual[1]}: pass the process group's rank and world size"
            )
        return actual
    if world_size > 1:
        raise OpdError(
            f"training with world_size={world_size} needs torch.distributed: launch the stage "
            "with `torchrun --nproc-per-node N` (or call dist.init_process_group first)"
        )
    return rank, world_size


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def wrap_ddp(module: nn.Module) -> nn.Module:
    """DistributedDataParallel around `module` when several ranks train, else `module` itself."""
    if not distributed() or dist.get_world_size() == 1:
        return module
    device = next(module.parameters()).device
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(module, device_ids=ids)


def shard_fsdp(module: nn.Module) -> nn.Module:
    """Shard `module`'s trainable parameters over the ranks (FSDP2 `fully_shard`, in place).

    Frozen parameters stay whole and untouched: the drafter's embedding IS the target's tensor
    (shared, never saved), and sharding it would detach it from the target."""
    from torch.distributed.fsdp import fully_shard

    frozen = {p for p in module.parameters() if not p.requires_grad}
    fully_shard(module, ignored_params=frozen)
    return module


def full_tensor(t: Tensor) -> Tensor:
    """`t` whole: gathered from every rank when FSDP shards it (a collective: every rank must
    call it, in the same order), else `t` itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_like(full: Tensor, like: Tensor) -> Tensor:
    """`full` held as `like` is: this rank's FSDP shard of it when `like` is sharded (cut
    locally: every rank read the same whole tensor), else `full` itself."""
    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(
        full.to(like.device), like.device_mesh, like.placements, src_data_rank=None
    )


def full_optimizer_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer's state_dict with every FSDP-sharded tensor gathered whole (a collective),
    so a checkpoint holds the same tensors whether or not training was sharded."""
    return {
        "state": {
            idx: {key: full_tensor(value) for key, value in entry.items()}
            for idx, entry in sorted(state["state"].items())
        },
        "param_groups": state["param_groups"],
    }


def all_reduce_sum(t: Tensor) -> Tensor:
    """Sum `t` over ranks in place (no-op in a single process); returns `t`."""
    if not distributed():
        return t
    if dist.get_backend() == "nccl" and t.device.type == "cpu":
        # NCCL reduces only GPU tensors; these sums are a handful of numbers
        on_gpu = t.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on_gpu, op=dist.ReduceOp.SUM)
        return t.copy_(on_gpu)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier() -> None:
    if distributed():
        dist.barrier()
