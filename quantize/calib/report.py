"""The files a calibrated conversion writes beside its shards: the calibration report (in the
manifest: what the same inputs always give), the AWQ scales as applied (for verify), the routed
tokens picture and the per-layer timings (not checksummed: wall-clock times and memory peaks).

The AWQ scales file (AWQ_SCALES, a subfolder: engines never load it) holds
  model.layers.L.mlp.awq_input_scale (H,): the MLP input's norm output is divided by it (the
      norm and its formula beside it as model.layers.L.mlp.awq_norm_fold: folds.NormFold,
      e.g. written norm = norm / s, or (1 + norm) / s - 1 for Gemma's), and every reader of
      it (experts' and shared gate/up, dense gate/up, router) has written = source * s along
      its input columns;
  <...>.down_proj.awq_input_scale (I,): written down_proj = source * s (columns) and the same
      expert's / MLP's up_proj = source / s (rows).
"""

from __future__ import annotations

from pathlib import Path

from quantize import SCHEMA_VERSION
from quantize.calib.folds import FOLD_KEY, NormFold, fold_tensor
from quantize.calib.layer import Carry
from quantize.names import AWQ_SCALES, CALIB_REPORT, CALIB_TIMINGS, ROUTED_PICTURE

__all__ = ["TIMING_KEYS", "write_reports"]
# Per layer: wall-clock seconds and peak GPU memory (CALIB_TIMINGS, a report beside the output,
# like verify.json: not in the manifest, so that the same inputs give the same checksummed bytes)
TIMING_KEYS = ("seconds", "load_s", "finish_s", "timing_s", "peak_gpu_gib", "peak_gpu_gib_by_phase",
               "rounding_sections_s")


def write_reports(out: Path, full: dict, carry: Carry, method: str) -> list[str]:
    """Write CALIB_REPORT (and AWQ_SCALES when AWQ ran), then the picture and the timings, into
    `out`; the names of the first two (the manifest lists them). `full`: the calibration's
    report with every layer's timings."""
    from safetensors.torch import save

    from quantize.write.shards import write_bytes_atomic, write_failed, write_json_atomic

    # the report in the manifest holds what the same inputs always give; the wall-clock
    # times and memory peaks go beside it, into a report that is not checksummed (last)
    write_json_atomic(out / CALIB_REPORT, {"schema_version": SCHEMA_VERSION, **full, "layers": [
        {k: v for k, v in lay.items() if k not in TIMING_KEYS} for lay in full["layers"]]})
    names = [CALIB_REPORT]
    try:
        (out / AWQ_SCALES).parent.mkdir(exist_ok=True)  # (calibration/, also the timings')
    except OSError as e:
        raise write_failed((out / AWQ_SCALES).parent, e) from None
    if "awq" in method:  # (no scales at all when every layer fell back to RTN)
        # serialized in memory (a few floats per channel), written like every other output:
        # atomically, and a full disk is the same clean error
        # each MLP input scale's norm fold (folds.NormFold), so verify re-applies the same:
        # as tensors beside it (safetensors' metadata is a map written in no fixed order;
        # these bytes must be the same for the same inputs)
        folds = {f"model.layers.{lay['layer']}.mlp.{FOLD_KEY}": fold_tensor(NormFold(
            f["norm"], f["formula"], f["bias"])) for lay in carry.layers
            if (f := (lay.get("awq") or {}).get("norm_fold"))}
        write_bytes_atomic(out / AWQ_SCALES, save({**carry.awq_scales, **folds},
                                                  metadata={"format": "pt"}))
        names.append(AWQ_SCALES)
    from quantize.publish import plots
    plots.routed_tokens(full, out / ROUTED_PICTURE)  # (a report, not
    # checksummed: None without matplotlib)
    write_json_atomic(out / CALIB_TIMINGS, {"schema_version": SCHEMA_VERSION, "layers": [
        {k: lay[k] for k in ("layer", *TIMING_KEYS) if k in lay} for lay in full["layers"]]})
    return names
