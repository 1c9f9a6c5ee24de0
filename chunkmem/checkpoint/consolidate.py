"""``chunkmem.consolidate``: a sharded checkpoint as one full-precision state dict, streamed.

The output has the keys of ``model.state_dict()`` (tied parameters under each name, buffers
included), so plain PyTorch loads it with ``model.load_state_dict(torch.load(out))`` and
Hugging Face ``from_pretrained`` reads a ``model.safetensors`` next to the model's config.
Only ``model.<name>`` tensors are read, one whole tensor at a time, straight from the DCP
files (no process group, ``.metadata`` read once): optimizer states are never loaded.

- ``.safetensors``: the header is written first from the manifest's shapes and dtypes, then
  each tensor's bytes in turn; peak memory is one tensor.
- ``.pt`` (or ``.pth``, ``.bin``): ``torch.save`` needs the whole dict, so the tensors are
  first streamed into a temporary safetensors file and handed to ``torch.save`` as views of
  that file mapped into memory: the bytes pass through the page cache, not the heap.

Both are written to a temporary file beside ``out``, fsynced, then renamed.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from chunkmem.checkpoint import commit
from chunkmem.checkpoint.planners import narrow
from chunkmem.errors import CheckpointError

_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH_DTYPES = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def consolidate(
    directory: str | os.PathLike,
    out: str | os.PathLike,
    dtype: torch.dtype | None = torch.float32,
) -> Path:
    """Write the model state of the checkpoint in ``directory`` to ``out`` (``.safetensors``,
    or ``.pt``/``.pth``/``.bin`` for ``torch.save``); floating-point tensors in ``dtype``
    (None: as stored, fp32 masters and frozen parameters in their compute dtype). Returns
    ``out``."""
    source, out = Path(directory), Path(out)
    problem = commit.incomplete(source)
    if problem is not None:
        raise CheckpointError(problem)
    if out.suffix != ".safetensors" and out.suffix not in _TORCH_SUFFIXES:
        raise CheckpointError(
            f"consolidate writes .safetensors or {'/'.join(_TORCH_SUFFIXES)} files (by the "
            f"suffix of out); got {out.name!r}"
        )
    manifest = commit.read_manifest(source)
    reader = TensorReader(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_name(f".{out.name}.chunkmem-tmp")
    try:
        if out.suffix == ".safetensors":
            _write_safetensors(temporary, reader, manifest["state_dict"], dtype)
        else:
            _write_torch(temporary, reader, manifest["state_dict"], dtype)
        os.rename(temporary, out)
        commit.fsync_directory(out.parent)
    finally:
        temporary.unlink(missing_ok=True)
    return out


class TensorReader:
    """Whole tensors of a DCP checkpoint, one at a time, in this process."""

    def __init__(self, path: Path) -> None:
        self._reader = FileSystemReader(path)
        self.metadata = self._reader.read_metadata()
        self._reader.set_up_storage_reader(self.metadata, is_coordinator=True)

    def info(self, key: str) -> TensorStorageMetadata:
        entry = self.metadata.state_dict_metadata.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"the checkpoint has no tensor {key!r}")
        return entry

    def read(self, key: str) -> torch.Tensor:
        info = self.info(key)
        tensor = torch.empty(info.size, dtype=info.properties.dtype)
        if tensor.numel() == 0:
            return tensor
        whole = ChunkStorageMetadata(torch.Size([0] * len(info.size)), info.size)
        reads = create_read_items_for_chunk_list(key, info, [whole])
        covered = sum(math.prod(r.lengths) for r in reads)
        if covered != tensor.numel():
            raise CheckpointError(
                f"the checkpoint holds {covered:,} of the {tensor.numel():,} elements of "
                f"{key!r}: it is incomplete"
            )
        self._reader.read_data(LoadPlan(reads), _Into(tensor)).wait()
        return tensor


class _Into:
    """The part of a load planner ``FileSystemReader.read_data`` calls: every read lands in
    one tensor."""

    def __init__(self, target: torch.Tensor) -> None:
        self.target = target

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return narrow(self.target, tuple(read_item.dest_offsets), tuple(read_item.lengths))

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        return None


def _output_dtype(stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and stored.is_floating_point else stored


def _write_safetensors(
    path: Path, reader: TensorReader, keys: list[list[str]], dtype: torch.dtype | None
) -> None:
    """``keys``: (output key, checkpoint key) pairs, written in that order."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, source in keys:
        info = reader.info(source)
        out_dtype = _output_dtype(info.properties.dtype, dtype)
        if out_dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{key!r} has dtype {out_dtype}, which safetensors cannot hold")
        nbytes = math.prod(info.size) * out_dtype.itemsize
        header[key] = {
            "dtype": _SAFETENSORS_DTYPES[out_dtype],
            "shape": list(info.size),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        for _key, source in keys:
            tensor = reader.read(source)
            tensor = tensor.to(_output_dtype(tensor.dtype, dtype)).contiguous()
            file.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
            del tensor
        file.flush()
        os.fsync(file.fileno())


def _write_torch(
    path: Path, reader: TensorReader, keys: list[list[str]], dtype: torch.dtype | None
) -> None:
    """Each stored tensor once into a mapped safetensors file; tied keys share a tensor, as
    in ``model.state_dict()``."""
    unique = list(dict.fromkeys(source for _key, source in keys))
    staging = path.with_name(path.name + ".staging.safetensors")
    try:
        _write_safetensors(staging, reader, [[s, s] for s in unique], dtype)
        with (
            open(staging, "rb") as file,
            mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY) as mapped,
        ):
            tensors = dict(_mapped_tensors(mapped))
            torch.save({key: tensors[source] for key, source in keys}, path)
            del tensors  # the mapping closes only once no tensor views it
        with open(path, "rb+") as file:
            os.fsync(file.fileno())
    finally:
        staging.unlink(missing_ok=True)


def _mapped_tensors(mapped: mmap.mmap) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a safetensors file, as views of its mapping."""
    (length,) = struct.unpack("<Q", mapped[:8])
    header = json.loads(mapped[8 : 8 + length])
    base = 8 + length
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        dtype = _TORCH_DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        shape = entry["shape"]
        if begin == end:
            yield key, torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(
            mapped, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=base + begin
        )
        yield key, flat.view(shape)
