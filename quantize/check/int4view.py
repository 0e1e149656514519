"""An output folder read as plain float weights (eval's and verify's view of DST).

    view = open_output(dst)          headers only
    view.read("<m>.weight")          a pack-quantized Linear, unpacked and dequantized (float32)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from quantize.errors import Problem, QuantizeError
from quantize.source.checkpoint import Checkpoint, TensorInfo, read_tensor_table

if TYPE_CHECKING:  # (torch is imported where tensors are read: `inspect` / `plan` of an
    import torch  # output read headers only)

__all__ = ["Int4View", "open_output"]


@dataclass
class Int4View(Checkpoint):
    """An output folder read as plain float weights: each pack-quantized Linear `<m>` is also
    listed as `<m>.weight` (float32 (N, K) = (q - zero_point) * scale, rounded to bf16 as the
    engines and compressed-tensors' decompression compute it); every other tensor as stored."""

    packed: dict[str, str] = field(default_factory=dict)  # `<m>.weight` -> `<m>`
    fp8_block: tuple[int, int] | None = None  # --keep-fp8 outputs of block-FP8 sources

    def read(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        m = self.packed.get(name)
        if m is None:
            t = self.tensors.get(name)
            scale = name[: -len("weight")] + "weight_scale" if name.endswith(".weight") else None
            if t is not None and t.dtype == "F8_E4M3" and scale in self.tensors:  # --keep-fp8
                from quantize.source.fp8 import dequant_block, dequant_channel

                w, s = super().read(name, device), super().read(scale, device)
                # the FP8 values times their scales, exactly (float32): what the engines' FP8
                # GEMMs multiply by, not the BF16 widening of it
                return dequant_block(w, s, self.fp8_block) if self.fp8_block else dequant_channel(w, s)
            return super().read(name, device)
        import torch

        from quantize.rounding.int4 import Int4Weight, dequantize, unpack_int4

        N, K = self.tensors[name].shape
        shape = [int(x) for x in super().read(m + ".weight_shape")]
        if shape != [N, K]:
            raise QuantizeError("an INT4 tensor disagrees with its own shape record", [Problem(
                self.tensors[m + ".weight_shape"].file, m + ".weight_shape", f"{shape}",
                f"[{N}, {K}] from weight_scale and the group size",
                "the output is corrupt: convert again with --overwrite")])
        q = unpack_int4(super().read(m + ".weight_packed", device), K)  # (N, K) int8
        zp = None
        if m + ".weight_zero_point" in self.tensors:  # (ceil(N/8), G) int32, packed along dim 0
            zp = unpack_int4(super().read(m + ".weight_zero_point", device), N, dim=0)
        scale = super().read(m + ".weight_scale", device)  # (N, G) bf16
        return dequantize(Int4Weight(q, scale, zp), torch.float32)


def open_output(dst: str | Path) -> Int4View:
    """A compressed-tensors pack-quantized folder as an `Int4View` (headers only; no data read)."""
    dst = Path(dst)
    tensors, files, sizes = read_tensor_table(dst)
    config = json.loads((dst / "config.json").read_text())
    qc = config.get("quantization_config") or {}
    all_groups = list((qc.get("config_groups") or {}).values())
    int4 = [g for g in all_groups if (g.get("weights") or {}).get("type") == "int"]
    fp8 = [g for g in all_groups if (g.get("weights") or {}).get("type") == "float"]
    groups = [g.get("weights") or {} for g in int4]
    mixed = qc.get("format") == "mixed-precision" and len(fp8) == 1 and len(all_groups) == 2
    ok = ((qc.get("format") == "pack-quantized" and len(all_groups) == 1) or mixed) and \
        len(groups) == 1 and groups[0].get("num_bits") == 4 and groups[0].get("strategy") == "group"
    block = (fp8[0].get("weights") or {}).get("block_structure") if mixed else None
    if not ok:
        raise QuantizeError("not a pack-quantized INT4 checkpoint", [Problem(
            str(dst / "config.json"), None, f"quantization_config format {qc.get('format')!r}, "
            f"weights {groups}", "one pack-quantized group of 4-bit int group-wise weights",
            "point DST at a folder written by `quantize convert`")])
    g = int(groups[0]["group_size"])
    packed, problems = {}, []
    for n, t in list(tensors.items()):
        if not n.endswith(".weight_packed"):
            continue
        m = n[: -len(".weight_packed")]
        s = tensors.get(m + ".weight_scale")
        if s is None or len(s.shape) != 2 or m + ".weight_shape" not in tensors:
            problems.append(Problem(t.file, n, "no 2-D weight_scale / weight_shape next to it",
                                    "weight_packed, weight_scale (N, K/group), weight_shape",
                                    "the output is incomplete: convert again with --overwrite"))
            continue
        N, K = s.shape[0], s.shape[1] * g
        if t.shape != (N, math.ceil(K / 8)):
            problems.append(Problem(t.file, n, f"shape {list(t.shape)}",
                                    f"[{N}, {math.ceil(K / 8)}] for weight_scale {list(s.shape)} "
                                    f"at group size {g}", "convert again with --overwrite"))
            continue
        tensors[m + ".weight"] = TensorInfo(m + ".weight", t.file, "F32", (N, K), 0, 0)  # virtual
        packed[m + ".weight"] = m
    if problems:
        raise QuantizeError("the INT4 tensors do not fit together", problems)
    return Int4View(dst, str(dst), config, tensors, files, sizes, "compressed-tensors", packed=packed,
                    fp8_block=tuple(block) if block else None)
