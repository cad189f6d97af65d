"""Ragged tensor columns in Arrow: one row = one sequence's [T, D] tensor.

Layout: `large_list<fixed_size_list<uint16|..., D>>`. The child values of a column are one
contiguous buffer of all rows' tensors back to back, so a reader hands the whole column to
torch without a per-row loop: values [sum T, D] plus row offsets [R + 1]. bf16 is carried as
its raw 2-byte pattern in uint16 (Arrow has no bf16), tagged with the true dtype in the field
metadata, so the round trip is bit-exact and costs 2 bytes a value.

Read from a memory-mapped IPC file, the returned tensor *is* the mapped file's memory
(zero-copy); it is read-only and must not be written to.
"""

from __future__ import annotations

import warnings

import numpy as np
import pyarrow as pa
import torch

from storage.errors import OpdError

# torch dtype -> (arrow storage type, numpy storage dtype, name in metadata)
_STORAGE: dict[torch.dtype, tuple[pa.DataType, np.dtype, str]] = {
    torch.bfloat16: (pa.uint16(), np.dtype(np.uint16), "bfloat16"),
    torch.float16: (pa.float16(), np.dtype(np.float16), "float16"),
    torch.float32: (pa.float32(), np.dtype(np.float32), "float32"),
    torch.int32: (pa.int32(), np.dtype(np.int32), "int32"),
    torch.int64: (pa.int64(), np.dtype(np.int64), "int64"),
}
_BY_NAME = {name: (dt, np_dt) for dt, (_, np_dt, name) in _STORAGE.items()}


def tensor_field(name: str, dtype: torch.dtype, dim: int) -> pa.Field:
    """The Arrow field for a ragged column of [T, dim] tensors of `dtype`."""
    if dtype not in _STORAGE:
        raise OpdError(f"column {name!r}: unsupported tensor dtype {dtype}")
    storage, _, dtype_name = _STORAGE[dtype]
    return pa.field(
        name,
        pa.large_list(pa.list_(storage, dim)),
        metadata={"opd.dtype": dtype_name, "opd.dim": str(dim)},
    )


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def tensor_array(tensors: list[torch.Tensor], field: pa.Field) -> pa.Array:
    """Pack a list of [T_i, D] tensors into one Arrow array matching `field` (one copy)."""
    dtype_name = field.metadata[b"opd.dtype"].decode()
    dim = int(field.metadata[b"opd.dim"])
    dtype, _ = _BY_NAME[dtype_name]
    for i, t in enumerate(tensors):
        if t.dim() != 2 or t.shape[1] != dim or t.dtype != dtype:
            raise OpdError(
                f"column {field.name!r} row {i}: expected a [T, {dim}] {dtype_name} tensor, "
                f"got {list(t.shape)} {t.dtype}"
            )
    lengths = np.array([t.shape[0] for t in tensors], dtype=np.int64)
    offsets = np.zeros(len(tensors) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = _to_numpy(torch.cat(tensors, 0)) if tensors else np.zeros((0, dim), np.uint16)
    values = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), dim)
    return pa.LargeListArray.from_arrays(pa.array(offsets), values)


def read_tensor_column(column: pa.Array | pa.ChunkedArray, field: pa.Field):
    """Zero-copy view of a ragged tensor column: (values [sum T, D], offsets int64 [R + 1]).

    Row i is values[offsets[i]:offsets[i + 1]]. Only single-chunk columns are zero-copy
    (each IPC record batch is one chunk; read shards batch by batch).
    """
    if isinstance(column, pa.ChunkedArray):
        if column.num_chunks != 1:
            raise OpdError(
                f"column {field.name!r} has {column.num_chunks} chunks; read it per record batch"
            )
        column = column.chunk(0)
    meta = field.metadata or {}
    if b"opd.dtype" not in meta:
        raise OpdError(f"column {field.name!r} is not a tensor column (no opd.dtype metadata)")
    dtype, np_dtype = _BY_NAME[meta[b"opd.dtype"].decode()]
    dim = int(meta[b"opd.dim"])
    offsets_buf = column.buffers()[1]
    offsets = np.frombuffer(offsets_buf, dtype=np.int64)[
        column.offset : column.offset + len(column) + 1
    ]
    child = column.values  # FixedSizeList, offset-adjusted by pyarrow for slices
    leaf_buf = child.values.buffers()[1]
    start, end = int(offsets[0]), int(offsets[-1])
    leaf_start = (child.offset + start) * dim + child.values.offset
    arr = np.frombuffer(leaf_buf, dtype=np_dtype)[leaf_start : leaf_start + (end - start) * dim]
    if dtype == torch.bfloat16:
        arr = arr.view(np.int16)
    with warnings.catch_warnings():
        # The mapped buffer is read-only; torch warns because it cannot enforce that.
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    if dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t.view(-1, dim), offsets - start
