"""Two converted folders side by side: per layer, the share of identical INT4 codes and of
identical bytes elsewhere (a multi-process run against a one-process run, scripts/bench_*).

    python3 benchmarks/history/scripts/compare_int4.py OUT_A OUT_B [--out cmp.json]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from quantize.rounding.int4 import unpack_int4
from quantize.source.layout import layer_of


def tensors(d: Path) -> dict[str, Path]:
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    return {n: d / f for n, f in index.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    ta, tb = tensors(args.a), tensors(args.b)
    if sorted(ta) != sorted(tb):
        raise SystemExit("the two folders hold different tensor names")
    per: dict[str, dict] = defaultdict(lambda: {"codes": 0, "codes_equal": 0, "other": 0, "other_equal": 0})

    def get(path: Path, name: str) -> torch.Tensor:
        with safe_open(path, "pt") as f:
            return f.get_tensor(name)

    for n in sorted(ta):
        if n.endswith(("weight_shape", "weight_scale", "weight_zero_point")):
            continue
        L = layer_of(n)
        row = per["-" if L is None else str(L)]
        a, b = get(ta[n], n), get(tb[n], n)
        if n.endswith("weight_packed"):
            K = int(get(ta[n], n.replace("weight_packed", "weight_shape"))[1])
            qa, qb = unpack_int4(a, K), unpack_int4(b, K)
            row["codes"] += qa.numel()
            row["codes_equal"] += int((qa == qb).sum())
        else:
            row["other"] += 1
            row["other_equal"] += int(torch.equal(a, b))
    res = {"a": str(args.a), "b": str(args.b), "layers": {
        k: {**v, "codes_equal_share": round(v["codes_equal"] / v["codes"], 6) if v["codes"] else None}
        for k, v in sorted(per.items(), key=lambda kv: (kv[0] == "-", int(kv[0]) if kv[0] != "-" else 0))}}
    for k, v in res["layers"].items():
        print(f"layer {k}: INT4 codes equal {v['codes_equal_share']}, other tensors equal "
              f"{v['other_equal']}/{v['other']}")
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
