"""Versioned, immutable datasets: layout, manifests, shards, tensor columns, provenance."""

from storage.dataset import Dataset
from storage.errors import CorruptDataset, DatasetNotFound, OpdError
from storage.fingerprint import canonical_json, dataset_version
from storage.layout import DatasetRef, check_run_name, default_root, disk_error, sha256_file
from storage.store import Store
from storage.tensors import read_tensor_column, tensor_array, tensor_field
from storage.writer import DatasetWriter

__all__ = [
    "CorruptDataset",
    "Dataset",
    "DatasetNotFound",
    "DatasetRef",
    "DatasetWriter",
    "OpdError",
    "Store",
    "canonical_json",
    "check_run_name",
    "dataset_version",
    "default_root",
    "disk_error",
    "read_tensor_column",
    "sha256_file",
    "tensor_array",
    "tensor_field",
]
