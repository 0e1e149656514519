"""Build the demo's small GLM-5-architecture FP8 checkpoint (random weights, exact release layout).

    python scripts/demo.py build demo/GLM-tiny-FP8
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from quantize.source.synth import tiny_config, write_checkpoint, write_tokenizer


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] != "build":
        sys.exit(__doc__)
    out = Path(sys.argv[2])
    if out.exists():
        shutil.rmtree(out)
    # 4 layers (first dense) + the MTP layer, 16 experts of width 256; attention dims ragged
    # (q_lora 96, kv_a 80) so FP8 blocks do not tile them.
    cfg = tiny_config("glm_moe_dsa", num_hidden_layers=4, n_routed_experts=16,
                      moe_intermediate_size=256, hidden_size=512)
    write_checkpoint(out, cfg, "fp8-block", seed=0, shard_bytes=4 * 2**20)
    write_tokenizer(out, cfg["vocab_size"])  # a real (tiny) tokenizer, for calibrated methods
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
