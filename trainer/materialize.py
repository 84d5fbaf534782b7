"""Models larger than a device: build on the meta device, shard, then give each rank only the values
it holds.

`build_model` builds the HF model's parameters on the meta device (no memory) and records how to
fill them (`PendingInit`). Each engine shards the empty model first (TP, FSDP2, a pipeline stage,
DeepSpeed ZeRO-3 partitions) and then calls `materialize` (or `materialize_zero3`), which writes
into every parameter only its local shard:

- a random init: each module's parameters get the values the unsplit model would have. The full
  values of one module at a time are drawn on the CPU by the model's own init (the module's
  `reset_parameters`, then HF's `_init_weights`, as `from_config` applies them) from a generator
  seeded by (seed, module name), and each rank keeps its slice. Keying the seed by name rather
  than drawing the whole model from one stream makes the values independent of the split and of
  which modules a rank holds (a pipeline stage draws only its own), at the price of one module's
  full values as a transient;
- `--weights DIR`: local safetensors read slice by slice (`safe_open(...).get_slice`), each rank
  reading only the rows/columns it holds, never a whole model.

Buffers (rotary frequencies) are built for real when the model is built (they are small) and
kept across `to_empty`.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from specs.errors import UsageError

PENDING = "pending_init"  # the attribute of a meta-built model that says how to fill it


@dataclass(frozen=True)
class PendingInit:
    """How to fill a meta-built model: a seeded random init through the model's own per-module
    `init_module`, or the safetensors of `weights`."""

    seed: int
    weights: str | None
    init_module: Callable[[torch.nn.Module], None]


def build_on_meta(build: Callable[[], torch.nn.Module], seed: int, weights: str | None) -> torch.nn.Module:
    """`build()` with its parameters on the meta device (buffers real: they are small and some
    are computed in `__init__`), marked with how to fill it."""
    from accelerate import init_empty_weights  # HF's own meta-device context; heavy, loaded when a model is built

    with init_empty_weights(include_buffers=False):
        model = build()
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # HF skips tying under init_empty_weights; tied parameters are one tensor again
    setattr(model, PENDING, PendingInit(seed, weights, model._init_weights))
    return model


def pending_init(model: torch.nn.Module) -> PendingInit | None:
    """How `model` is still to be filled; None once it holds values (or was built for real)."""
    return getattr(model, PENDING, None)


def materialize(module: torch.nn.Module, init: PendingInit | None, device: torch.device) -> None:
    """Give every parameter of `module` (a whole model, one pipeline stage, a TP/FSDP2-sharded
    model) storage on `device` and its local values; no-op when `init` is None (already real)."""
    if init is None:
        return
    _give_storage(module, device)
    _fill(module, init, _local_target)
    for holder in (module, *module.modules()):
        if getattr(holder, PENDING, None) is not None:
            delattr(holder, PENDING)


def materialize_zero3(model: torch.nn.Module, init: PendingInit | None, config: dict[str, Any]) -> None:
    """DeepSpeed ZeRO-3: partition `model` with DeepSpeed's own `zero.Init` (as if it had been
    built inside the context), then write each rank's partition. The parameters are first given
    empty CPU storage: untouched pages cost no memory, and `zero.Init` holds one whole parameter
    at a time while it partitions."""
    if init is None:
        return
    import deepspeed  # heavy optional dependency: only ZeRO plans load it

    dtype = _zero3_dtype(config)
    if dtype is not None:
        model.to(dtype)  # on the meta device, free: DeepSpeed partitions in the dtype it computes in
    _give_storage(model, torch.device("cpu"))
    deepspeed.init_distributed()  # zero.Init reads the world size from DeepSpeed's comm, as initialize would set it
    deepspeed.zero.Init(module=model, config_dict_or_path=config)
    _fill(model, init, _zero3_target)
    delattr(model, PENDING)


def _zero3_dtype(config: dict[str, Any]) -> torch.dtype | None:
    if config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if config.get("fp16", {}).get("enabled"):
        return torch.float16
    return None


def _give_storage(module: torch.nn.Module, device: torch.device) -> None:
    """Uninitialised storage on `device` for every parameter (`to_empty`, which FSDP2 follows by
    re-pointing its sharded storage), keeping the ties and the buffers' values that it drops."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers() if not b.is_meta}
    tied = _tied_attributes(module)
    module.to_empty(device=device)
    for owner, attr, source in tied:  # to_empty gives each holder of a tied tensor its own copy
        setattr(owner, attr, getattr(*source))
    for name, buffer in module.named_buffers():
        if name in buffers:
            buffer.copy_(buffers[name])


def _tied_attributes(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, tuple[torch.nn.Module, str]]]:
    """(owner, attribute, (first owner, attribute)) of every parameter held by two modules
    (tied embeddings), to tie again after `to_empty`."""
    first: dict[int, tuple[torch.nn.Module, str]] = {}
    out = []
    for owner in module.modules():
        for attr, p in owner._parameters.items():
            if p is None:
                continue
            if id(p) in first:
                out.append((owner, attr, first[id(p)]))
            else:
                first[id(p)] = (owner, attr)
    return out


# -- filling: which values (init or weights), where they go (plain, DTensor shard, ZeRO-3 partition)


Target = Callable[[torch.Tensor], tuple[torch.Tensor, "Slicer"]]
Slicer = Callable[[Callable[[tuple[slice, ...]], torch.Tensor], torch.Size], torch.Tensor]


def _fill(module: torch.nn.Module, init: PendingInit, target: Target) -> None:
    """Each parameter once (tied ones by their first name), module by module."""
    done: set[int] = set()
    with _weights(init.weights) as read, torch.no_grad():
        for name, owner in module.named_modules():
            own = [(attr, p) for attr, p in owner._parameters.items() if p is not None and id(p) not in done]
            done.update(id(p) for _, p in own)
            if own:
                _fill_module(owner, name, own, init, target, read)


def _fill_module(owner: torch.nn.Module, name: str, own: list[tuple[str, torch.Tensor]], init: PendingInit,
                 target: Target, read: Any) -> None:
    """One module's parameters: its full values (drawn, or read by slices) live only in here, so
    that the transient is one module's, not two."""
    values = None if read is not None else _initial_values(owner, name, init)
    for attr, p in own:
        local, part = target(p)
        full_name = f"{name}.{attr}" if name else attr
        if read is not None:
            value = part(read(full_name), _global_shape(p))
        else:
            full = values[attr]
            value = part(lambda index, full=full: full[index], full.shape)
        local.copy_(value.reshape(local.shape))


def _initial_values(module: torch.nn.Module, name: str, init: PendingInit) -> dict[str, torch.Tensor]:
    """The full fp32 values of `module`'s own parameters as the unsplit model draws them, on
    scratch CPU tensors of the global shape, from a generator seeded by (seed, module name).

    HF's construction runs torch's `reset_parameters` of each layer and then the model's
    `_init_weights`, which overwrites what it covers. We run `_init_weights` first and fall back
    to that order only for modules whose parameters it left untouched (a NaN in the first and
    last element, as inits fill whole tensors): the same distribution without drawing every
    weight twice or scanning it."""
    real = dict(module._parameters)
    try:
        scratch = []
        for attr, p in real.items():
            if p is not None:
                fresh = torch.empty(_global_shape(p), dtype=torch.float32)
                if fresh.numel():
                    fresh.view(-1)[[0, -1]] = float("nan")
                module._parameters[attr] = torch.nn.Parameter(fresh, requires_grad=False)
                scratch.append(fresh)
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(_module_seed(init.seed, name))  # CPU only: the scratch is there
            init.init_module(module)
            if any(t.numel() and t.view(-1)[[0, -1]].isnan().any() for t in scratch) \
                    and hasattr(module, "reset_parameters"):
                torch.default_generator.manual_seed(_module_seed(init.seed, name))
                module.reset_parameters()  # torch's own init, what HF's construction runs first
                init.init_module(module)
        return {attr: p.data for attr, p in module._parameters.items() if p is not None}
    finally:
        module._parameters.update(real)


def _module_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _global_shape(p: torch.Tensor) -> torch.Size:
    shape = getattr(p, "ds_shape", None)
    return torch.Size(shape) if shape is not None else p.shape


def _local_target(p: torch.Tensor) -> tuple[torch.Tensor, Slicer]:
    """A plain tensor takes everything; a DTensor (TP, FSDP2) its local shard."""
    from torch.distributed.tensor import DTensor  # ~0.5 s to import: loaded when first needed

    if not isinstance(p, DTensor):
        return p, lambda read, shape: read(tuple(slice(0, n) for n in shape))
    index = _dtensor_index(p)
    return p.to_local(), lambda read, shape: _read_blocks(read, index)


def _zero3_target(p: torch.Tensor) -> tuple[torch.Tensor, Slicer]:
    """A ZeRO-3 parameter takes its partition: the flattened tensor, padded to a multiple of the
    group size, cut into equal consecutive pieces (DeepSpeed's `_partition_param`)."""
    local = p.ds_tensor
    size = local.ds_numel
    start = size * dist.get_rank(group=p.ds_process_group)

    def part(read: Callable[[tuple[slice, ...]], torch.Tensor], shape: torch.Size) -> torch.Tensor:
        row = max(1, int(torch.Size(shape[1:]).numel())) if len(shape) > 1 else 1
        stop = min(start + size, shape.numel())
        out = torch.empty(size, dtype=local.dtype)
        out[max(0, stop - start):] = 0  # DeepSpeed's padding of the last partition
        if stop > start:
            first, last = start // row, -(-stop // row)
            rows = read((slice(first, last),)).reshape(-1)
            out[: stop - start] = rows[start - first * row: stop - first * row]
        return out

    return local, part


def _dtensor_index(p: Any) -> list[torch.Tensor]:
    """Per dimension, the global indices this rank's shard of DTensor `p` holds: `torch.chunk` of
    `arange(n)` by every mesh dimension that shards it, in the order the engines apply them: plain
    shards first (TP, or FSDP2 alone), then strided ones (FSDP2 sharding the TP-local rows).
    Written out because DTensor exposes only offsets, which strided shards do not have."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    coordinate = p.device_mesh.get_coordinate()
    index = [torch.arange(n) for n in p.shape]
    placements = list(enumerate(p.placements))
    ordered = [m for m in placements if not isinstance(m[1], _StridedShard)] + \
              [m for m in placements if isinstance(m[1], _StridedShard)]
    for mesh_dim, placement in ordered:
        if isinstance(placement, (Shard, _StridedShard)):
            chunks = torch.chunk(index[placement.dim], p.device_mesh.size(mesh_dim))
            mine = coordinate[mesh_dim]
            index[placement.dim] = chunks[mine] if mine < len(chunks) else index[placement.dim][:0]
    return index


def _runs(index: torch.Tensor) -> list[slice]:
    """Consecutive runs of sorted indices, as slices (one slice for a plain chunk)."""
    values = index.tolist()
    runs: list[slice] = []
    start = prev = None
    for v in values:
        if start is None:
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            runs.append(slice(start, prev + 1))
            start = prev = v
    if start is not None:
        runs.append(slice(start, prev + 1))
    return runs


def _read_blocks(read: Callable[[tuple[slice, ...]], torch.Tensor], index: list[torch.Tensor]) -> torch.Tensor:
    """The sub-tensor at the cartesian product of `index`, read block by block."""
    if any(len(i) == 0 for i in index):
        return torch.empty([len(i) for i in index])
    return _gather(read, [_runs(i) for i in index], ())


def _gather(read: Callable[[tuple[slice, ...]], torch.Tensor], runs: list[list[slice]],
            prefix: tuple[slice, ...]) -> torch.Tensor:
    # a module-level recursion, not a closure: a self-referencing closure is a cycle that would
    # keep each module's full values alive until the garbage collector runs
    dim = len(prefix)
    if dim == len(runs):
        return read(prefix)
    blocks = [_gather(read, runs, prefix + (run,)) for run in runs[dim]]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=dim)


class _WeightsReader:
    """Tensors of a folder of safetensors by name, read by slices."""

    def __init__(self, folder: Path):
        from safetensors import safe_open  # optional dependency of --weights

        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise UsageError(f"--weights {folder}: no .safetensors files there")
        self.handles = [safe_open(str(f), framework="pt") for f in files]
        self.where = {key: h for h in self.handles for key in h.keys()}

    def __call__(self, name: str) -> Callable[[tuple[slice, ...]], torch.Tensor]:
        handle = self.where.get(name)
        if handle is None:
            raise UsageError(f"--weights: the checkpoint has no tensor {name!r}")
        sliced = handle.get_slice(name)
        return lambda index: sliced[index] if index else sliced[:]


def _weights(folder: str | None) -> Any:
    """A context giving the reader of `folder`'s tensors, or None for a random init."""
    return contextlib.nullcontext(_WeightsReader(Path(folder)) if folder else None)
