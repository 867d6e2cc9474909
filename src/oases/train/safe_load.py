"""Reading a DCP checkpoint without running code that was pickled into it.

``torch.distributed.checkpoint``'s ``FileSystemReader`` unpickles ``.metadata`` with plain
``pickle`` and loads byte entries with ``torch.load(weights_only=False)``. Here ``.metadata``
goes through an unpickler that resolves only DCP's metadata dataclasses, ``torch.Size``, dtypes,
layouts, memory formats and a few containers (anything else is refused), tensors are read with
``weights_only`` loading, and the load planner refuses byte entries.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

# The globals a DCP .metadata pickle may name (module -> names); anything else is refused.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # looks a torch.layout up by its name, nothing else
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
                return value
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")


def load_metadata(path: Path) -> Metadata:
    """DCP's ``.metadata`` of checkpoint ``path`` without running pickled code; ValueError."""
    try:
        with open(path / ".metadata", "rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
    except OSError as exc:
        raise ValueError(f"checkpoint {path}: cannot read .metadata ({exc.strerror})") from None
    except Exception as exc:  # a truncated or foreign pickle: any unpickling error
        raise ValueError(f"checkpoint {path}: corrupt .metadata ({exc})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise ValueError(f"checkpoint {path}: .metadata is not a DCP index")
    bad = [
        k
        for k, v in metadata.state_dict_metadata.items()
        if not isinstance(v, TensorStorageMetadata)
    ]
    if bad:
        raise ValueError(f"checkpoint {path}: non-tensor entries {bad[:3]} are not accepted")
    return metadata


class SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose metadata goes through the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise ValueError(f"checkpoint {self.path}: per-rank metadata is not supported")
        metadata = load_metadata(Path(self.path))
        metadata.storage_meta = metadata.storage_meta or dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorOnlyPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise ValueError(f"refusing a non-tensor checkpoint entry {read_item.dest_index.fqn}")
