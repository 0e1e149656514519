"""Read a Hugging Face safetensors checkpoint lazily: index, headers, validation, tensor reads.

A safetensors file is `u64 little-endian header length N`, then `N` bytes of JSON
`{name: {"dtype": "F8_E4M3", "shape": [out, in], "data_offsets": [begin, end]}, ...}`,
then the data; offsets are relative to the first byte after the header. We parse the
header ourselves (no data read: `plan` and `inspect` stay header-only, and a truncated or
corrupt file is named precisely) and read each tensor with one positioned read, so host
memory holds only the tensors being converted, never a whole shard mapping.

The source format is decided by `config.json`:

    fp8-block    quant_method "fp8", weight_block_size [128, 128]   (GLM-5.x, DeepSeek-V3)
                 `<m>.weight` F8_E4M3 [N, K] + `<m>.weight_scale_inv` F32 [ceil(N/128), ceil(K/128)]
    fp8-channel  quant_method "compressed-tensors", format float-quantized (GLM-4.x FP8)
                 `<m>.weight` F8_E4M3 [N, K] + `<m>.weight_scale` [N, 1]
    bf16         no quantization_config; no F8 tensors allowed
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from quantize.errors import Problem, QuantizeError
from quantize.names import INDEX_NAME, SINGLE_NAME

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPE_BYTES",
    "Checkpoint",
    "SourceFormat",
    "TensorInfo",
    "gc_paused",
    "link_problem",
    "open_checkpoint",
    "read_safetensors_header",
    "st_dtype",
    "torch_dtype",
]

# safetensors dtype string -> bytes per element (headers only: no torch needed)
DTYPE_BYTES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}
_TORCH_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def torch_dtype(st: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype string (torch imported here, on first use: the
    header-only commands never import it)."""
    import torch

    return getattr(torch, _TORCH_NAMES[st])


def st_dtype(dtype: torch.dtype) -> str | None:
    """The safetensors dtype string of a torch dtype (None: one safetensors does not hold)."""
    name = str(dtype).removeprefix("torch.")
    return next((k for k, v in _TORCH_NAMES.items() if v == name), None)


MAX_HEADER = 100 * 2**20  # safetensors' own limit is 100 MB


class SourceFormat:
    FP8_BLOCK = "fp8-block"
    FP8_CHANNEL = "fp8-channel"
    BF16 = "bf16"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str  # shard file name, relative to the checkpoint folder
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    begin: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Checkpoint:
    """A checkpoint known from its config, index and shard headers. Data is read on demand."""

    root: Path | None  # None for a Hub repo read header-only
    name: str  # what the user passed, for messages
    config: dict
    tensors: dict[str, TensorInfo]
    files: list[str]
    file_sizes: dict[str, int]
    source_format: str
    block_size: tuple[int, int] | None = None
    _handles: dict[str, object] = field(default_factory=dict, repr=False)
    # when a dict: every `read` kept in it by (name, device) and answered from it (verify reads
    # a layer's tensors for its per-tensor checks, then again for its layer forward; the caller
    # empties it between layers, so it holds at most one layer). Callers never modify a result.
    memo: dict | None = field(default=None, repr=False)
    # True: each tensor's bytes are dropped from the OS page cache once read (a reader that
    # reads each byte once, with a thread reading ahead of it: the cache keeps the pages read
    # ahead instead of the ones done with, which it would otherwise count as in use)
    drop_read: bool = field(default=False, repr=False)

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", "unknown"))

    @property
    def num_hidden_layers(self) -> int:
        return int(self.config.get("num_hidden_layers", 0))

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def read(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """Read one tensor's bytes with positioned reads (no mmap kept around). To a CUDA
        device the bytes go through reusable pinned buffers (`_staged_read`); to the host, into
        a new buffer the returned tensor owns."""
        if self.root is None:
            raise QuantizeError(
                f"{self.name} was opened header-only (Hub repo id); tensor data is not available",
                [Problem(self.name, name, "no local files", "a local folder",
                         "download it first: `quantize convert` accepts the repo id and downloads")],
            )
        import torch

        dev = torch.device(device)
        if self.memo is None:
            return self._read(name, dev)
        key = (name, str(dev))
        t = self.memo.get(key)
        if t is None:
            t = self.memo[key] = self._read(name, dev)
        return t

    def _read(self, name: str, dev: torch.device) -> torch.Tensor:
        import torch

        info = self.tensors[name]
        dtype = torch_dtype(info.dtype)
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=dtype, device=dev)
        with open(self.root / info.file, "rb", buffering=0) as f:
            if dev.type == "cuda":
                t = _staged_read(f.fileno(), info, dev)
            else:
                t = torch.empty(info.nbytes, dtype=torch.uint8)
                _read_exact(f.fileno(), memoryview(t.numpy()), info, 0)
            if self.drop_read:
                os.posix_fadvise(f.fileno(), info.begin, info.nbytes, os.POSIX_FADV_DONTNEED)
        return t.view(dtype).reshape(info.shape)

    def nonfinite(self, names: list[str], workers: int = 8) -> list[str]:
        """Those of the named float tensors holding a NaN or an infinity, in the order given.
        Built for many small tensors (GLM-5.2's 59,044 FP8 scales, read one by one, took ~4 s
        of the start-up, and from a cold disk each is a small read of its own): one open per
        file, each file's tensors read in offset order into one buffer, `workers` files at
        once (the reads release the GIL), one check per file and dtype."""
        import torch

        by_file: dict[str, list[TensorInfo]] = {}
        for n in dict.fromkeys(names):
            by_file.setdefault(self.tensors[n].file, []).append(self.tensors[n])

        def bad_in(file: str) -> set[str]:
            infos = sorted(by_file[file], key=lambda t: t.begin)
            offs = [0]
            for t in infos:
                offs.append(offs[-1] + t.nbytes)
            buf = torch.empty(offs[-1], dtype=torch.uint8)
            view = memoryview(buf.numpy())
            with open(self.root / file, "rb", buffering=0) as f:
                for t, o in zip(infos, offs):
                    _read_exact(f.fileno(), view[o:o + t.nbytes], t, 0)

            def values(group: list[tuple[TensorInfo, int]]) -> torch.Tensor:  # (copied: aligned)
                return torch.cat([buf[o:o + t.nbytes] for t, o in group]).view(torch_dtype(group[0][0].dtype))

            bad = set()
            for dtype in dict.fromkeys(t.dtype for t in infos):  # one check per dtype
                group = [(t, o) for t, o in zip(infos, offs) if t.dtype == dtype]
                if not torch.isfinite(values(group)).all():
                    bad.update(t.name for t, o in group if not torch.isfinite(values([(t, o)])).all())
            return bad

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max(1, min(workers, len(by_file)))) as pool:
            bad = set().union(*pool.map(bad_in, by_file)) if by_file else set()
        return [n for n in dict.fromkeys(names) if n in bad]

    def prefetch(self, names: list[str], chunk: int = 8 * 2**20,
                 stop: Callable[[], bool] = lambda: False) -> None:
        """Read the tensors' bytes into the OS page cache (and drop them): a later `read` of
        them comes from memory. For a thread that runs ahead of the reads; file order, so the
        disk sees long sequential reads; `stop()` is asked between chunks. Errors are left to
        the real read."""
        if self.root is None:
            return
        spans = sorted((self.tensors[n].file, self.tensors[n].begin, self.tensors[n].nbytes)
                       for n in names if n in self.tensors)
        buf = memoryview(bytearray(chunk))
        handles: dict[str, int] = {}
        try:
            for file, begin, nbytes in spans:
                if file not in handles:
                    handles[file] = os.open(self.root / file, os.O_RDONLY)
                off, end = begin, begin + nbytes
                while off < end and not stop():
                    got = os.preadv(handles[file], [buf[:min(chunk, end - off)]], off)
                    if got <= 0:
                        break
                    off += got
        except OSError:
            pass
        finally:
            for fd in handles.values():
                os.close(fd)


def _read_exact(fd: int, buf: memoryview, info: TensorInfo, offset: int) -> None:
    """Fill `buf` from the tensor's bytes at `offset`, or name the truncated shard."""
    got = os.preadv(fd, [buf], info.begin + offset)
    if got != len(buf):
        raise QuantizeError(
            "a shard is shorter than its header says",
            [Problem(info.file, info.name, f"read {offset + got} of {info.nbytes} bytes",
                     "the full tensor", "re-download the shard (it is truncated)")],
        )


def _staged_read(fd: int, info: TensorInfo, device: torch.device) -> torch.Tensor:
    """The tensor's bytes in a new uint8 tensor on `device`, read through pinned chunks
    (`quantize.source.staging`): chunk i+1 is read from the file while chunk i is copied. The copy
    stream is synchronized before returning, so the tensor is complete for any stream."""
    import torch

    from quantize.source.staging import CHUNK, staging

    user = torch.cuda.current_stream(device)  # where the caller will use the tensor
    with staging(device) as st:
        with torch.cuda.stream(st.stream):  # allocated on the copy stream: written only there
            out = torch.empty(info.nbytes, dtype=torch.uint8, device=device)
            for i, off in enumerate(range(0, info.nbytes, CHUNK)):
                b = i % 2
                n = min(CHUNK, info.nbytes - off)
                st.done[b].synchronize()  # the copy that last used this buffer has finished
                _read_exact(fd, st.views[b][:n], info, off)
                out[off:off + n].copy_(st.bufs[b][:n], non_blocking=True)
                st.done[b].record(st.stream)
        st.stream.synchronize()
    # freed later on the caller's stream: the allocator waits for that stream's work before
    # handing the memory to the copy stream again
    out.record_stream(user)
    return out


def read_safetensors_header(path: Path, shown_name: str) -> tuple[dict[str, dict], int]:
    """Parse and validate one safetensors header; return (header, first data byte).

    Raises QuantizeError naming the file and tensor when the header is corrupt or the file
    is shorter than the header promises (a truncated download).
    """

    def bad(found: str, expected: str, fix: str = "re-download this shard") -> QuantizeError:
        return QuantizeError("corrupt safetensors file", [Problem(shown_name, None, found, expected, fix)])

    size = path.stat().st_size
    if size < 8:
        raise bad(f"{size} bytes", "at least the 8-byte header length")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER or n > size - 8:
            raise bad(f"header length {n} in a {size}-byte file", "a header that fits in the file")
        raw = f.read(n)
    twice: list[str] = []

    def unique(pairs: list[tuple[str, object]]) -> dict:  # json.loads would keep the last silently
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                twice.append(k)
            seen.add(k)
        return dict(pairs)

    try:
        header = json.loads(raw, object_pairs_hook=unique)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"header is not valid JSON ({e.__class__.__name__}: {e})", "a JSON header") from None
    if not isinstance(header, dict):
        raise bad(f"header is a {type(header).__name__}", "a JSON object")
    if twice:
        raise bad(f"the header names {twice[0]} twice", "each name once (as safetensors requires)")
    data_start = 8 + n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        ok = (
            isinstance(entry, dict)
            and entry.get("dtype") in DTYPE_BYTES
            and isinstance(entry.get("shape"), list)
            and all(isinstance(d, int) and d >= 0 for d in entry["shape"])
            and isinstance(entry.get("data_offsets"), list)
            and len(entry["data_offsets"]) == 2
            and all(type(o) is int for o in entry["data_offsets"])
        )
        if not ok:
            raise QuantizeError("corrupt safetensors header", [Problem(
                shown_name, name, f"entry {json.dumps(entry)[:200]}",
                f"dtype in {sorted(DTYPE_BYTES)}, an integer shape and two data offsets",
                "re-download this shard")])
        begin, end = entry["data_offsets"]
        need = math.prod(entry["shape"]) * DTYPE_BYTES[entry["dtype"]]
        if end - begin != need or begin < 0:
            raise QuantizeError("corrupt safetensors header", [Problem(
                shown_name, name, f"data_offsets {begin}..{end} ({end - begin} bytes)",
                f"{need} bytes for {entry['dtype']}{entry['shape']}", "re-download this shard")])
        if data_start + end > size:
            raise QuantizeError("truncated safetensors file", [Problem(
                shown_name, name, f"data ends at byte {data_start + end} but the file has {size}",
                "the whole tensor inside the file",
                "re-download this shard (the download or copy was cut short)")])
    _check_layout(header, size - data_start, shown_name)
    return header, data_start


def _check_layout(header: dict, data_bytes: int, shown_name: str) -> None:
    """The entries' byte ranges tile the data section exactly, in order: none shares bytes with
    another (two names reading the same weights), no hole, nothing after the last one, as the
    safetensors format requires (its own reader refuses such a file)."""
    spans = sorted((e["data_offsets"][0], e["data_offsets"][1], k) for k, e in header.items()
                   if k != "__metadata__")
    at, prev = 0, None
    for begin, end, name in spans:
        if begin < at:
            raise QuantizeError("corrupt safetensors header", [Problem(
                shown_name, name, f"data_offsets {begin}..{end} overlap {prev}'s bytes (up to {at})",
                "tensors that share no bytes", "re-download this shard")])
        if begin > at:
            raise QuantizeError("corrupt safetensors header", [Problem(
                shown_name, name, f"data starts at {begin}, after {begin - at} bytes no tensor uses",
                "tensors packed back to back from byte 0 of the data", "re-download this shard")])
        at, prev = end, name
    if at != data_bytes:
        raise QuantizeError("corrupt safetensors file", [Problem(
            shown_name, prev, f"{data_bytes - at} bytes after the last tensor",
            "a file that ends with its last tensor", "re-download this shard")])


def link_roots(root: Path) -> tuple[Path, ...]:
    """Where files of `root` may really live: the folder itself, and for a Hugging Face cache
    snapshot (`.../snapshots/<rev>/`, every file a symlink) the repo's `blobs/` folder."""
    real = root.resolve()
    roots = [real]
    snapshots = root.absolute().parent
    if snapshots.name == "snapshots" and snapshots.parent.name.startswith("models--"):
        roots.append(snapshots.parent.resolve() / "blobs")
    return tuple(roots)


def escapes(root: Path, path: Path) -> Path | None:
    """The real target of `path` when it is a link leading outside `link_roots(root)`; a link
    that never ends (a loop) counts as leading outside, named by itself."""
    try:
        real = path.resolve()
        if path.is_symlink():
            os.stat(path)  # (Python 3.13's resolve() returns a loop's path without an error)
    except FileNotFoundError:  # a dangling link: read (and refused) where it is used
        pass
    except (RuntimeError, OSError):  # a symlink loop: never followed
        return path
    if any(r in real.parents for r in link_roots(root)):
        return None
    return real


def link_problem(root: Path, path: Path) -> Problem | None:
    """A Problem when `path` (a file of the model folder `root`) is a link leading outside it:
    it would be read or copied from wherever it points (another model, a secret)."""
    real = escapes(root, path) if path.is_symlink() else None
    if real is None:
        return None
    return Problem(str(path), None, f"a link to {real}", "files inside the model folder",
                   "copy the file into the folder, or remove the link")


def _safe_member(root: Path, name: str, index_file: str, tensor: str | None = None) -> Path:
    """The path of a shard named by the index, refusing anything that leaves `root`."""
    p = Path(name)
    problem = None
    if p.is_absolute() or name.startswith(("/", "\\")):
        problem = "an absolute path"
    elif any(part == ".." for part in p.parts) or "\\" in name:
        problem = "a path that climbs out of the folder"
    elif len(p.parts) != 1:
        problem = "a path into a subfolder"
    if problem is None:
        full = root / name
        if full.is_symlink() or full.exists():
            real = escapes(root, full)
            if real is not None:
                problem = f"a link that points outside the model folder (to {real})"
        if problem is None:
            return full
    raise QuantizeError("the index names a shard outside the model folder", [Problem(
        index_file, tensor, f"shard name {name!r} is {problem}",
        "a plain file name inside the model folder",
        "this checkpoint is malformed or hostile; do not use it, or fix the index by hand")])


# config.json fields the tool reads, each an integer in a range (absent is fine): a value of
# another type or out of range is refused before it is used (a string, 0 or 10**10 crashed or
# exhausted memory before). Upper bounds far above any release (GLM-5.2: 78 layers, 256
# experts, hidden 6144, vocab 154,880).
CONFIG_INTS = {
    "num_hidden_layers": (1, 10_000), "num_nextn_predict_layers": (0, 64),
    "n_routed_experts": (1, 1 << 16), "num_experts_per_tok": (1, 1 << 16),
    "n_shared_experts": (0, 1 << 10), "first_k_dense_replace": (0, 10_000),
    "hidden_size": (1, 1 << 20), "intermediate_size": (1, 1 << 22),
    "moe_intermediate_size": (1, 1 << 22), "vocab_size": (1, 1 << 24),
    "num_attention_heads": (1, 1 << 16), "num_key_value_heads": (1, 1 << 16),
    "index_topk": (0, 1 << 24), "max_position_embeddings": (1, 1 << 30),
}


# config.json numbers the layers compute with, each a finite number in an open range (absent
# is fine): a config that converts with RTN but cannot run a layer (rms_norm_eps -1) is refused
# before any output, not by a traceback in verify's layer check.
CONFIG_FLOATS = {
    "rms_norm_eps": (0.0, 1.0), "layer_norm_eps": (0.0, 1.0), "rope_theta": (0.0, 1e12),
    "routed_scaling_factor": (0.0, 1e6),
}


def _non_finite(obj: object, path: str = "") -> list[str]:
    """The fields of a parsed JSON value holding NaN or +-Infinity (Python's json reads them;
    JSON has no such numbers), by dotted path."""
    if isinstance(obj, float):
        return [] if math.isfinite(obj) else [path or "(the whole file)"]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _non_finite(v, f"{path}.{k}" if path else str(k))]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in _non_finite(v, f"{path}[{i}]")]
    return []


def _config_relations(config: dict, shown: str) -> list[Problem]:
    """What the layer classes need of the integers together (each alone already in range)."""
    def num(k):
        v = config.get(k)
        return v if type(v) is int else None

    problems = []
    fix = "restore the release's config.json"
    experts = num("n_routed_experts") or num("num_experts") or num("num_local_experts")
    per_token = num("num_experts_per_tok")
    if experts and per_token and per_token > experts:
        problems.append(Problem(shown, "num_experts_per_tok", f"num_experts_per_tok = {per_token}",
                                f"at most the {experts} experts there are", fix))
    groups, topk_group = num("n_group"), num("topk_group")
    if groups is not None and (groups < 1 or (experts and experts % groups)):
        problems.append(Problem(shown, "n_group", f"n_group = {groups}",
                                f"a positive divisor of the {experts} routed experts", fix))
    elif groups and topk_group is not None and not 1 <= topk_group <= groups:
        problems.append(Problem(shown, "topk_group", f"topk_group = {topk_group}",
                                f"1..{groups} (n_group)", fix))
    heads, kv = num("num_attention_heads"), num("num_key_value_heads")
    if heads and kv and heads % kv:
        problems.append(Problem(shown, "num_key_value_heads", f"num_key_value_heads = {kv}",
                                f"a divisor of num_attention_heads {heads}", fix))
    return problems


def _validate_config(config: dict, shown: str) -> None:
    problems = [Problem(shown, f, f"{f} is NaN or Infinity", "a finite number (JSON has no NaN)",
                        "restore the release's config.json") for f in _non_finite(config)]
    for k, (lo, hi) in CONFIG_INTS.items():
        v = config.get(k)
        if v is None:
            continue
        if type(v) is not int or not lo <= v <= hi:
            problems.append(Problem(shown, k, f"{k} = {json.dumps(v)[:60]}",
                                    f"an integer in {lo}..{hi:,}", "restore the release's config.json"))
    for k, (lo, hi) in CONFIG_FLOATS.items():
        v = config.get(k)
        if v is None:
            continue
        if type(v) not in (int, float) or not (math.isfinite(v) and lo < v < hi):
            problems.append(Problem(shown, k, f"{k} = {str(v)[:60]}",
                                    f"a number in ({lo:g}, {hi:g})", "restore the release's config.json"))
    if not problems:
        problems += _config_relations(config, shown)
    qc = config.get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") == "fp8" and "weight_block_size" in qc:
        b = qc["weight_block_size"]
        if not (isinstance(b, list) and len(b) == 2 and all(type(x) is int and 1 <= x <= 1 << 16 for x in b)):
            problems.append(Problem(shown, "quantization_config.weight_block_size",
                                    f"weight_block_size = {json.dumps(b)[:60]}",
                                    "two positive integers, e.g. [128, 128]",
                                    "restore the release's config.json"))
    if problems:
        raise QuantizeError("config.json has values the tool cannot use", problems)


def _detect_format(config: dict, tensors: dict[str, TensorInfo]) -> tuple[str, tuple[int, int] | None]:
    qc = config.get("quantization_config")
    has_fp8 = any(t.dtype.startswith("F8") for t in tensors.values())
    if qc is None:
        if has_fp8:
            first = next(t for t in tensors.values() if t.dtype.startswith("F8"))
            raise QuantizeError("FP8 tensors without a quantization_config", [Problem(
                "config.json", first.name, "F8 weights and no quantization_config",
                "a quantization_config describing the FP8 scales",
                "use the config.json that shipped with these weights")])
        return SourceFormat.BF16, None
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3" or not (isinstance(block, list) and len(block) == 2):
            raise QuantizeError("unsupported FP8 layout", [Problem(
                "config.json", None, f"fmt={fmt!r}, weight_block_size={block!r}",
                "fmt e4m3 with a two-element weight_block_size (block FP8)",
                "only DeepSeek-style block FP8 is supported for quant_method fp8")])
        return SourceFormat.FP8_BLOCK, (int(block[0]), int(block[1]))
    if method == "compressed-tensors":
        fmt = qc.get("format")
        groups = qc.get("config_groups") or {}
        weights = [g.get("weights") or {} for g in groups.values()]
        float8 = all(w.get("type") == "float" and w.get("num_bits") == 8 for w in weights) and weights
        if fmt in ("float-quantized", "naive-quantized") and float8 and all(
            w.get("strategy") in ("channel", "tensor") for w in weights
        ):
            return SourceFormat.FP8_CHANNEL, None
        if fmt in ("pack-quantized", "mixed-precision"):
            raise QuantizeError("an INT4 checkpoint, not a source", [Problem(
                "config.json", None, f"format={fmt!r} (INT4, e.g. written by `quantize convert`)",
                "an FP8 or BF16 source checkpoint",
                "check an output with `quantize verify SRC DST` and measure it with "
                "`quantize eval SRC DST`; INT4 weights cannot be re-quantized")])
        raise QuantizeError("unsupported compressed-tensors source", [Problem(
            "config.json", None, f"format={fmt!r}, weights={weights}",
            "float-quantized FP8 weights with per-channel or per-tensor scales (GLM-4.x FP8)",
            "convert from the FP8 or BF16 release of the model")])
    raise QuantizeError("unknown quantization method", [Problem(
        "config.json", None, f"quant_method={method!r}",
        "fp8 (block), compressed-tensors float-quantized FP8, or no quantization_config (BF16)",
        "convert from the FP8 or BF16 release; already-quantized INT checkpoints cannot be re-quantized")])


def _validate_scales(ckpt: Checkpoint) -> None:
    """Every F8 tensor must be a 2-D `.weight` with a scale of the right dtype and shape, and
    a block-FP8 config's block size the one those shapes imply."""
    if ckpt.source_format == SourceFormat.FP8_BLOCK and (bp := _block_size_problems(ckpt)):
        raise QuantizeError("config.json's FP8 block size does not match the scales", bp)
    problems: list[Problem] = []
    for t in ckpt.tensors.values():
        if not t.dtype.startswith("F8"):
            continue
        if t.dtype != "F8_E4M3" or not t.name.endswith(".weight") or len(t.shape) != 2:
            problems.append(Problem(t.file, t.name, f"{t.dtype}{list(t.shape)}",
                                    "F8_E4M3 2-D `.weight` tensors only",
                                    "this FP8 layout is not a supported release format"))
            continue
        n, k = t.shape
        stem = t.name[: -len("weight")]
        if ckpt.source_format == SourceFormat.FP8_BLOCK:
            sname = stem + "weight_scale_inv"
            bn, bk = ckpt.block_size
            want_shape, want_dtypes = (math.ceil(n / bn), math.ceil(k / bk)), ("F32", "BF16")
        else:
            sname = stem + "weight_scale"
            want_shape, want_dtypes = (n, 1), ("F32", "BF16", "F16")
        s = ckpt.tensors.get(sname)
        if s is None:
            problems.append(Problem(t.file, t.name, f"no `{sname}` in the index",
                                    f"its scale {sname} {want_dtypes[0]}{list(want_shape)}",
                                    "re-download the checkpoint; an FP8 weight without its scale "
                                    "cannot be dequantized"))
        elif s.shape not in (want_shape, (n,)) or s.dtype not in want_dtypes or (
            s.shape == (n,) and ckpt.source_format == SourceFormat.FP8_BLOCK
        ):
            problems.append(Problem(s.file, sname, f"{s.dtype}{list(s.shape)}",
                                    f"{'/'.join(want_dtypes)}{list(want_shape)} for weight "
                                    f"{list(t.shape)}", "the scale does not belong to this weight; "
                                    "re-download the checkpoint"))
    if ckpt.source_format == SourceFormat.FP8_CHANNEL:
        for t in ckpt.tensors.values():
            if t.name.endswith(".input_scale"):
                problems.append(Problem(t.file, t.name, "a static activation scale",
                                        "dynamic activations (no input_scale)",
                                        "static-activation FP8 checkpoints are not supported"))
    if problems:
        raise QuantizeError("the FP8 weights and their scales do not match", problems)


def _block_size_problems(ckpt: Checkpoint) -> list[Problem]:
    """The declared weight_block_size against the block sizes the scales' shapes allow: a
    weight of n rows with nb scale rows fits blocks b with ceil(n / b) == nb, i.e.
    ceil(n / nb) <= b <= floor((n - 1) / (nb - 1)); every FP8 weight narrows the range, per
    axis. A size outside it, or not a power of two (the block-FP8 kernels' and every release's
    128), would dequantize with the wrong scale boundaries."""
    lo, hi = [1, 1], [1 << 30, 1 << 30]
    for t in ckpt.tensors.values():
        s = ckpt.tensors.get(t.name[: -len("weight")] + "weight_scale_inv")
        if not t.dtype.startswith("F8") or s is None or len(s.shape) != 2:
            continue
        for ax, (n, nb) in enumerate(zip(t.shape, s.shape)):
            lo[ax] = max(lo[ax], -(-n // nb))
            if nb > 1:
                hi[ax] = min(hi[ax], (n - 1) // (nb - 1))
    b = list(ckpt.block_size)
    fits = all(lo[i] <= b[i] <= hi[i] for i in range(2))
    pow2 = all(x & (x - 1) == 0 for x in b)
    if (fits and pow2) or not all(lo[i] <= hi[i] for i in range(2)):
        return []  # right, or no one block fits every scale: the per-tensor check names them
    implied = " x ".join(f"{lo[i]}" if lo[i] == hi[i] else f"{lo[i]}..{min(hi[i], 1 << 16)}"
                         for i in range(2))
    guess = [128 if lo[i] <= 128 <= hi[i] else lo[i] for i in range(2)]
    return [Problem("config.json", "quantization_config.weight_block_size",
                    f"weight_block_size = {b}" + ("" if pow2 else " (not a power of two)"),
                    f"the block the scales' shapes imply ({implied} per axis), a power of two",
                    f"restore the release's config.json (weight_block_size {guess})")]


_FLOAT = ("BF16", "F16", "F32")
_SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")


def _validate_dtypes(ckpt: Checkpoint) -> None:
    """Dtypes the source format allows, and no scale without its FP8 weight.

    Weights and biases are floats (an I8/U8 `.weight` is raw bytes of some other format, not
    values); an FP8 release holds F8_E4M3 Linears and BF16/F32 for the rest (its scales are
    checked by `_validate_scales`), a BF16 checkpoint BF16/F16/F32. A `weight_scale(_inv)`
    whose weight is not FP8 would be copied into the output beside a BF16 or INT4 weight and
    silently ignored or misapplied by an engine.
    """
    fp8 = ckpt.source_format in (SourceFormat.FP8_BLOCK, SourceFormat.FP8_CHANNEL)
    allowed = ("F8_E4M3", "BF16", "F32") if fp8 else _FLOAT
    problems: list[Problem] = []
    for t in ckpt.tensors.values():
        suffix = next((x for x in _SCALE_SUFFIXES if t.name.endswith("." + x)), None)
        if suffix is not None:
            w = ckpt.tensors.get(t.name[: -len(suffix)] + "weight")
            if w is None or not w.dtype.startswith("F8"):
                found = "no weight" if w is None else f"weight {w.name} is {w.dtype}"
                problems.append(Problem(t.file, t.name, f"a scale, but {found}",
                                        "scales only beside F8_E4M3 weights",
                                        "re-download the checkpoint; a scale without its FP8 "
                                        "weight belongs to another format"))
            continue
        if t.dtype.startswith("F8"):
            continue  # `_validate_scales`
        # any float the format lacks; other dtypes only where values are expected (an I64
        # buffer elsewhere is copied as is)
        if t.dtype not in allowed and (t.dtype.startswith("F") or t.name.endswith((".weight", ".bias"))):
            problems.append(Problem(t.file, t.name, t.dtype,
                                    f"one of {', '.join(allowed)} in a {ckpt.source_format} "
                                    "checkpoint", "re-download the checkpoint, or convert from "
                                    "the model's FP8 or BF16 release"))
    if problems:
        raise QuantizeError("tensors of a dtype this format does not allow", problems)


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _validate_experts(ckpt: Checkpoint) -> None:
    """Routed experts must have the config's shapes, and every MoE layer all of its experts.

    gate_proj / up_proj [moe_intermediate_size, hidden_size], down_proj [hidden_size,
    moe_intermediate_size], experts 0 .. n_routed_experts-1 each with all three. An engine
    builds its fused expert tensors from the config, so any mismatch fails at load time (or,
    worse, loads a truncated expert); we refuse before writing anything.
    """
    cfg = ckpt.config
    width, hidden, count = (cfg.get("moe_intermediate_size"), cfg.get("hidden_size"),
                            cfg.get("n_routed_experts"))
    want = {"gate_proj": (width, hidden), "up_proj": (width, hidden), "down_proj": (hidden, width)}
    problems: list[Problem] = []
    seen: dict[str, set[tuple[int, str]]] = {}
    for t in ckpt.tensors.values():
        m = _EXPERT.match(t.name)
        if m is None:
            continue
        prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
        seen.setdefault(prefix, set()).add((expert, proj))
        if width and hidden and t.shape != want[proj]:
            problems.append(Problem(t.file, t.name, f"shape {list(t.shape)}",
                                    f"{list(want[proj])} from config.json (moe_intermediate_size "
                                    f"{width}, hidden_size {hidden})",
                                    "use the config.json that shipped with these weights"))
        if count and expert >= count:
            problems.append(Problem(t.file, t.name, f"expert {expert}",
                                    f"experts 0..{count - 1} (n_routed_experts {count})",
                                    "use the config.json that shipped with these weights"))
    if seen:  # routed experts in the weights: the config's sizes of them must be usable
        for k in ("n_routed_experts", "moe_intermediate_size"):
            if k in cfg and cfg[k] is None:
                problems.append(Problem("config.json", k, f"{k} = null",
                                        "the number the release's config.json has (the engines "
                                        "size the fused expert tensors from it)",
                                        "restore the release's config.json"))
    if count:
        for prefix, have in sorted(seen.items()):
            missing = [f"{e}.{p}" for e in range(count) for p in want if (e, p) not in have]
            if missing:
                problems.append(Problem(INDEX_NAME, f"{prefix}.{missing[0]}.weight",
                                        f"{len(missing)} expert weight(s) missing "
                                        f"(first: {missing[0]})",
                                        f"{count} experts x gate/up/down_proj per MoE layer",
                                        "the download is incomplete; re-download the checkpoint"))
    if problems:
        raise QuantizeError("the routed experts do not match config.json", problems)


_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")
# Architectures whose decoder layers of one kind (dense MLP or MoE) hold the same tensors.
_UNIFORM_LAYERS = ("glm_moe_dsa", "glm4_moe", "deepseek_v3")


def _validate_layers(ckpt: Checkpoint) -> None:
    """Layers 0 .. num_hidden_layers-1 (+ the MTP layers) and no others; for the GLM family,
    every decoder layer holds the tensors the other layers of its kind hold (an incomplete
    download or an edited index otherwise converts into a model that fails at load)."""
    cfg = ckpt.config
    n = cfg.get("num_hidden_layers")
    if not isinstance(n, int) or n < 1:
        return
    extra = cfg.get("num_nextn_predict_layers") or 0
    layers: dict[int, dict[str, TensorInfo]] = {}
    for t in ckpt.tensors.values():
        m = _LAYER_NAME.match(t.name)
        if m:
            layers.setdefault(int(m.group(1)), {})[_EXPERT_INDEX.sub(".experts.*.", m.group(2))] = t
    # GLM-5.x keeps a DSA indexer only in some layers (`index_topk_freq`): not compared
    uniform = {L: {k for k in names if ".indexer." not in k} for L, names in layers.items()}
    problems: list[Problem] = []
    for L in sorted(layers):
        if L >= n + extra:
            t = next(iter(layers[L].values()))
            problems.append(Problem(t.file, t.name, f"layer {L}",
                                    f"layers 0..{n + extra - 1} (num_hidden_layers {n}"
                                    + (f" + num_nextn_predict_layers {extra})" if extra else ")"),
                                    "use the config.json that shipped with these weights"))
    missing = [L for L in range(n) if L not in layers]
    if missing:
        problems.append(Problem(INDEX_NAME, f"model.layers.{missing[0]}.*",
                                f"no tensors for layer(s) {', '.join(map(str, missing[:10]))}"
                                + (" ..." if len(missing) > 10 else ""),
                                f"layers 0..{n - 1} (num_hidden_layers {n})",
                                "the download is incomplete; re-download the checkpoint"))
    if cfg.get("model_type") in _UNIFORM_LAYERS:
        moe = {L: any(".experts.*." in k for k in uniform[L]) for L in range(n) if uniform.get(L)}
        kinds: dict[bool, set[str]] = {}
        for L, is_moe in moe.items():
            kinds.setdefault(is_moe, set()).update(uniform[L])
        for L, is_moe in moe.items():
            lost = sorted(kinds[is_moe] - uniform[L])
            if lost:
                problems.append(Problem(INDEX_NAME, f"model.layers.{L}.{lost[0]}",
                                        f"layer {L} lacks {len(lost)} tensor(s) its sibling layers "
                                        f"have (first: {lost[0]})",
                                        "every layer of a kind with the same tensors",
                                        "the download is incomplete; re-download the checkpoint"))
    if problems:
        raise QuantizeError("the decoder layers do not match config.json", problems[:20])


def read_tensor_table(root: Path) -> tuple[dict[str, TensorInfo], list[str], dict[str, int]]:
    """Index (or single file) + every shard header of a local folder -> tensors, files, sizes.

    Refuses shard names that leave the folder, missing shards, corrupt or truncated headers,
    and index entries absent from their shard.
    """
    index_path = root / INDEX_NAME
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (KeyError, TypeError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise QuantizeError("unreadable index", [Problem(
                str(index_path), None, f"{e.__class__.__name__}: {e}", "JSON with a weight_map",
                "restore the release's model.safetensors.index.json")]) from None
    elif (root / SINGLE_NAME).is_file():
        header, _ = read_safetensors_header(root / SINGLE_NAME, SINGLE_NAME)
        weight_map = {n: SINGLE_NAME for n in header if n != "__metadata__"}
    else:
        raise QuantizeError("no weights found", [Problem(
            str(root), None, f"neither {INDEX_NAME} nor {SINGLE_NAME}", "safetensors weights",
            "only safetensors checkpoints are supported (convert .bin files with transformers first)")])

    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise QuantizeError("unreadable index", [Problem(
            str(index_path), None, "a weight_map that is not {tensor: file name}",
            "JSON with a weight_map of strings", "restore the release's model.safetensors.index.json")])
    files = sorted(set(weight_map.values()))
    first = {}  # file -> the first tensor the index places in it, to name in messages
    for name, fname in weight_map.items():
        first.setdefault(fname, name)
    problems: list[Problem] = []
    headers: dict[str, tuple[dict, int]] = {}
    sizes: dict[str, int] = {}
    for fname in files:
        path = _safe_member(root, fname, INDEX_NAME, first[fname])
        if not path.is_file():
            problems.append(Problem(INDEX_NAME, first[fname], f"shard {fname} does not exist",
                                    "every shard the index names", "download the missing shard"))
            continue
        headers[fname] = read_safetensors_header(path, fname)
        sizes[fname] = path.stat().st_size
    if problems:
        raise QuantizeError("the index names missing files", problems)

    tensors: dict[str, TensorInfo] = {}
    for name, fname in weight_map.items():
        header, data_start = headers[fname]
        entry = header.get(name)
        if entry is None:
            problems.append(Problem(fname, name, "not in this shard's header",
                                    "the tensor the index promises",
                                    "the index and shards are from different revisions; re-download"))
            continue
        begin, end = entry["data_offsets"]
        tensors[name] = TensorInfo(name, fname, entry["dtype"], tuple(entry["shape"]),
                                   data_start + begin, end - begin)
    if problems:
        raise QuantizeError("tensors listed in the index are missing from their shards", problems)
    for fname, (header, _) in headers.items():  # and the other way round
        for name in header:
            listed = weight_map.get(name)
            if name == "__metadata__" or listed == fname:
                continue
            if listed is None:
                problems.append(Problem(fname, name, "in this shard but not in the index",
                                        f"every tensor of every shard listed in {INDEX_NAME}",
                                        "the index is stale or was edited: restore the release's "
                                        "index (a tensor it does not list would be left out)"))
            else:
                problems.append(Problem(fname, name, f"also in {listed}, where the index places it",
                                        "each tensor in one shard",
                                        "the shards come from different revisions: re-download"))
    if problems:
        raise QuantizeError("the index and the shard headers disagree", problems[:20])
    return tensors, files, sizes


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector held off while a block builds many long-lived objects and
    no cycles (GLM-5.2's ~120,000 header entries, its plan's ~180,000 tensors): left on, its
    full collections scan them again and again as they are made (~1 s of an open and a plan
    on a 2-core host: BENCHMARKS.md). Usable as a decorator; nested or concurrent uses leave
    the collector as they found it or on."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@gc_paused()
def open_checkpoint(src: str | Path) -> Checkpoint:
    """Read config, index and every shard header of a local checkpoint; validate; read no data."""
    root = Path(src)
    if not root.is_dir():
        raise QuantizeError("source not found", [Problem(
            str(src), None, "no such folder", "a folder with config.json and *.safetensors",
            "pass a local checkpoint folder or a Hub repo id (org/name)")])
    # the files read before the index names the shards (whose links `_safe_member` checks)
    links = [p for n in ("config.json", INDEX_NAME, SINGLE_NAME) if (p := link_problem(root, root / n))]
    if links:
        raise QuantizeError("the source links to files outside the model folder", links)
    config_path = root / "config.json"
    if not config_path.is_file():
        there = config_path.exists() or config_path.is_symlink()
        raise QuantizeError("no config.json", [Problem(
            str(config_path), None, "not a regular file (a pipe, device, folder or dangling link)"
            if there else "missing", "the model's config.json",
            "copy config.json from the model release into the folder")])
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise QuantizeError("config.json is not valid JSON", [Problem(
            str(config_path), None, str(e), "valid JSON", "restore the release's config.json")]) from None
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(config, dict) or not isinstance(qc, (dict, type(None))):
        raise QuantizeError("config.json is not a model config", [Problem(
            str(config_path), None, "a JSON value that is not {key: value} (or a quantization_config "
            "that is not)", "a JSON object", "restore the release's config.json")])

    _validate_config(config, str(config_path))
    tensors, files, sizes = read_tensor_table(root)
    fmt, block = _detect_format(config, tensors)
    ckpt = Checkpoint(root, str(src), config, tensors, files, sizes, fmt, block)
    _validate_dtypes(ckpt)
    _validate_scales(ckpt)
    _validate_experts(ckpt)
    _validate_layers(ckpt)
    return ckpt


def checkpoint_from_headers(name: str, config: dict, headers: dict[str, dict]) -> Checkpoint:
    """Build a header-only Checkpoint (no data access), e.g. from the Hub's metadata API.

    `headers` maps file name -> {tensor: {"dtype", "shape", "data_offsets"}}.
    """
    tensors = {
        t: TensorInfo(t, fname, e["dtype"], tuple(e["shape"]), 0,
                      e["data_offsets"][1] - e["data_offsets"][0])
        for fname, h in headers.items() for t, e in h.items() if t != "__metadata__"
    }
    _validate_config(config, f"{name}/config.json")
    fmt, block = _detect_format(config, tensors)
    sizes = {f: sum(e["data_offsets"][1] - e["data_offsets"][0] for t, e in h.items()
                    if t != "__metadata__") for f, h in headers.items()}
    ckpt = Checkpoint(None, name, config, tensors, sorted(headers), sizes, fmt, block)
    _validate_dtypes(ckpt)
    _validate_scales(ckpt)
    _validate_experts(ckpt)
    _validate_layers(ckpt)
    return ckpt
