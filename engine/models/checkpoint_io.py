"""Reading checkpoint files and loading them into meta-built modules.

Format-neutral plumbing shared by every model: find the tensor files behind a path
(a file, a sharded safetensors index, or a directory), read them without executing
pickled code, and copy tensors into a module built on the meta device so that peak host
memory stays near one copy of the weights. Key renaming between checkpoint layouts lives
in each model's conversion module, not here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

SAFETENSORS_SUFFIXES = (".safetensors",)
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
SHOW_FIRST = 8


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and what is wrong."""


def checkpoint_files(path: str | Path) -> list[Path]:
    """Resolve a user-given path to the tensor files it stands for, in load order."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    if not (p.is_file() or p.is_dir()):  # a device (/dev/zero) or a FIFO would block or never end
        raise CheckpointError(f"{p}: not a regular file or directory; expected a checkpoint file "
                              f"({', '.join(SAFETENSORS_SUFFIXES + PICKLE_SUFFIXES)}) or a directory of them")
    if p.is_file() and p.name.endswith(".index.json"):
        return _index_shards(p)
    if p.is_file():
        if not p.name.endswith(SAFETENSORS_SUFFIXES + PICKLE_SUFFIXES):
            raise CheckpointError(
                f"{p}: unknown checkpoint format; allowed: "
                f"{', '.join(SAFETENSORS_SUFFIXES + PICKLE_SUFFIXES)} or a *.safetensors.index.json"
            )
        return [p]
    indexes = sorted(p.glob("*.safetensors.index.json"))
    if indexes:
        return _index_shards(indexes[0])
    files = sorted(f for f in p.glob("*.safetensors") if f.is_file()) or sorted(
        f for f in p.iterdir() if f.name.endswith(PICKLE_SUFFIXES) and f.is_file()
    )
    if not files:
        raise CheckpointError(f"{p}: directory holds no .safetensors, .pt or .pth checkpoint")
    return files


def _index_shards(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
    shards = [index.parent / name for name in dict.fromkeys(weight_map.values())]
    missing = [s.name for s in shards if not s.is_file()]
    if missing:
        raise CheckpointError(f"{index}: shards listed in the index are missing: {missing[:SHOW_FIRST]}")
    return shards


def iter_tensors(files: Iterable[Path], *, meta: bool = False) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """Yield (key, tensor, file) for every tensor in the files, one file in memory at a time; `meta`: only
    their names, shapes and dtypes (tensors on the meta device), which reads no weights."""
    for f in files:
        yield from ((k, v, f) for k, v in _read_file(f, meta).items())


def _read_file(f: Path, meta: bool = False) -> dict[str, torch.Tensor]:
    if f.name.endswith(SAFETENSORS_SUFFIXES):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return _safetensors_meta(f) if meta else load_file(str(f), device="cpu")
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"{f}: unreadable safetensors file ({_one_line(exc)})") from None
    try:  # mmap: nothing is read until a tensor is used (the meta check uses none)
        obj = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many types for truncated or foreign pickles
        try:
            obj = torch.load(str(f), map_location="cpu", weights_only=True)
        except Exception:
            raise CheckpointError(f"{f}: unreadable checkpoint ({type(exc).__name__}: {_one_line(exc)})") from None
    tensors = _unwrap(obj, f)
    return {k: v.to("meta") for k, v in tensors.items()} if meta else tensors


def _safetensors_meta(f: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    with safe_open(str(f), framework="pt") as st:
        for key in st.keys():
            part = st.get_slice(key)
            dtype = _SAFETENSORS_DTYPES.get(part.get_dtype(), torch.float32)
            out[key] = torch.empty(part.get_shape(), dtype=dtype, device="meta")
    return out


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def _one_line(exc: BaseException) -> str:
    """The first line of an error from a reader (torch's unpickling errors run to a dozen lines), short."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip().splitlines()  # and no terminal colours
    return (text[0] if text else type(exc).__name__)[:300]


def _unwrap(obj: object, f: Path) -> dict[str, torch.Tensor]:
    """Find the tensor dict inside common wrappers ({'generator': ...}, {'state_dict': ...})."""
    for key in ("generator_ema", "generator", "state_dict", "model", "module"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            inner = obj[key]
            if inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
                return inner
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    raise CheckpointError(f"{f}: holds no tensor dictionary (top-level keys: {_head(obj)})")


def _head(obj: object) -> list[str]:
    return [str(k) for k in list(obj)[:SHOW_FIRST]] if isinstance(obj, dict) else [type(obj).__name__]


def load_into_module(
    module: nn.Module,
    files: list[Path],
    rename: Callable[[str], str | None],
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    keep: Callable[[str], bool] = lambda name: True,
) -> None:
    """Fill a (meta-built) module from checkpoint files, strictly.

    `rename` maps a checkpoint key to the module's parameter name, or None to skip keys that
    are known not to belong to the module (for example optimizer state). `keep` selects which
    module parameters to load (a block range for a pipeline rank); the others are dropped
    from the module's expectations. Fails with CheckpointError naming the files, the missing
    and unexpected keys and the shape mismatches; nothing is ever left randomly initialised.
    """
    everything = _named_tensors(module)
    expected = {k: v for k, v in everything.items() if keep(k)}
    loaded: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    mismatched: list[str] = []
    mismatched_names: set[str] = set()
    for key, tensor, _ in iter_tensors(files, meta=torch.device(device).type == "meta"):
        name = rename(key)
        if name is None:
            continue
        if name not in expected:
            if name in everything:
                continue
            unexpected.append(key)
            continue
        if tuple(tensor.shape) != tuple(expected[name].shape):
            mismatched.append(f"{key}: file {tuple(tensor.shape)} vs model {tuple(expected[name].shape)}")
            mismatched_names.add(name)
            continue
        target_dtype = dtype if (dtype is not None and tensor.is_floating_point()) else expected[name].dtype
        loaded[name] = tensor.to(device=device, dtype=target_dtype)
    missing = [k for k in expected if k not in loaded and k not in mismatched_names]
    if missing or unexpected or mismatched:
        raise CheckpointError(_report(files, missing, unexpected, mismatched))
    module.load_state_dict(loaded, strict=False, assign=True)
    if torch.device(device).type == "meta":  # a check of keys and shapes: everything stays on meta by design
        return
    stray = [k for k, v in _named_tensors(module).items() if v.is_meta and keep(k)]
    if stray:
        raise CheckpointError(_report(files, stray, [], []))


def _named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict(module.state_dict(keep_vars=True))


def _report(files: list[Path], missing: list[str], unexpected: list[str], mismatched: list[str]) -> str:
    where = str(files[0]) if len(files) == 1 else f"{files[0].parent} ({len(files)} files)"
    parts = [f"{where}: checkpoint does not match the model"]
    for label, items in (("missing keys", missing), ("unexpected keys", unexpected),
                         ("shape mismatches", mismatched)):
        if items:
            parts.append(f"{len(items)} {label}, first: {items[:SHOW_FIRST]}")
    return "; ".join(parts)
