"""Which precision a device runs natively, and the words a stage's lines use to say so.

`auto` settings (`target.dtype`, `sft.bf16`, `opd.bf16`) resolve here. bf16 counts as native
on CUDA and on CPUs with AMX tiles, where bf16 matrix kernels outrun fp32 ones. CPUs with
AVX-512-BF16 but no AMX stay fp32: the same oneDNN kernels (`brg_matmul:avx512_core_bf16`)
ran at 0.4-0.75x fp32's speed on an Intel Xeon (Emerald Rapids) but 1.3-2.3x faster on an AMD
EPYC (Zen 4; docs/scale.md), where bf16 is set explicitly for now. An AVX2-only CPU emulates
bf16 (SmolLM2's drafter step took 7.8x its fp32 time) and stays fp32 too.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

Bf16Setting = Literal["auto"] | bool
"""A training stage's `bf16`: `auto` (bf16 autocast where the device runs bf16 natively),
true (bf16 autocast, emulated where the CPU lacks bf16 kernels) or false (fp32)."""


@functools.cache
def cpu_capability() -> str:
    """The best matrix instructions this CPU offers torch: `AMX`, `AVX-512-BF16`, `AVX-512`,
    `AVX2`, or torch's own capability name on other architectures."""
    cpu = torch.cpu
    if cpu._is_amx_tile_supported():
        return "AMX"
    if cpu._is_avx512_bf16_supported():
        return "AVX-512-BF16"
    if cpu._is_avx512_supported():
        return "AVX-512"
    if cpu._is_avx2_supported():
        return "AVX2"
    return torch.backends.cpu.get_cpu_capability()


def native_bf16(device_type: str) -> bool:
    """Whether bf16 runs at least as fast as fp32 on this device type: CUDA, or a CPU with AMX
    (see the module docstring for the measurements behind the rule)."""
    return device_type != "cpu" or cpu_capability() == "AMX"


def resolve_bf16(setting: Bf16Setting, device: torch.device) -> bool:
    """Whether a training stage's `bf16` setting trains in bf16 autocast on `device`."""
    return native_bf16(device.type) if setting == "auto" else setting


def device_name(device: torch.device) -> str:
    """`cpu AVX-512-BF16`, `cuda:0 NVIDIA H100 80GB HBM3`: what a stage's line says it ran on."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} {torch.cuda.get_device_name(index)}"
    if device.type == "cpu":
        return f"cpu {cpu_capability()}"
    return str(device)
