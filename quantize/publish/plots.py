"""Pictures of the reports, for people who would rather look than read (the `plots` extra).

    sqnr_by_layer(verify.json dict, DST/verify-sqnr.png)            verify
    errors_by_layer(eval.json dict, calib report | None, DST/eval-layers.png)   eval
    routed_tokens(calibration-report dict, DST/calibration/routed-tokens.png)   calibrated convert

Each returns the path written, or None when matplotlib is not installed (`pip install
glm-int4-quantize[plots]`) or the report has nothing to draw; the JSON reports hold the same
numbers either way. The PNGs are reports beside the checkpoint (not among the manifest's
checksummed files); the card embeds the ones that exist and `push` uploads them with it.
PNG metadata carries no software version or date, so the same numbers give the same bytes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from quantize.names import PICTURES

__all__ = ["PICTURES", "available", "errors_by_layer", "routed_tokens", "sqnr_by_layer"]



def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _figure(width: float = 8.0, height: float = 4.0):
    import matplotlib

    matplotlib.use("Agg", force=True)  # files only, never a window
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # layers and experts are whole
    return fig, ax


def _save(fig, path: Path) -> Path:
    import io

    from quantize.write.shards import write_bytes_atomic

    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, buf.getvalue())
    return path


def _layer(name: str) -> int | None:
    from quantize.source.layout import layer_of

    return layer_of(name)


def sqnr_by_layer(report: dict, path: Path) -> Path | None:
    """Each quantized tensor's SQNR (dB) at its layer, by role, with verify's floor."""
    if not available():
        return None
    pts: dict[str, list[tuple[int, float]]] = {}
    for t in report.get("tensors", []):
        L, sq = _layer(t["name"]), t.get("sqnr_db")
        if t.get("action") != "quantize" or L is None or not isinstance(sq, (int, float)):
            continue
        role = "routed" if ".experts." in t["name"] else "shared" if "shared_experts" in t["name"] \
            else "dense"
        pts.setdefault(role, []).append((L, float(sq)))
    if not pts:
        return None
    fig, ax = _figure()
    for role, xy in sorted(pts.items()):
        ax.scatter([x for x, _ in xy], [y for _, y in xy], s=6, alpha=0.6, label=f"{role} ({len(xy)})")
    floor = report.get("min_sqnr_db_threshold")
    if isinstance(floor, (int, float)):
        ax.axhline(floor, color="red", lw=1, ls="--", label=f"verify floor {floor:g} dB")
    ax.set_xlabel("layer")
    ax.set_ylabel("SQNR (dB), higher is better")
    ax.set_title("INT4 tensors against their source")
    ax.legend(loc="best", fontsize=8)
    return _save(fig, path)


def errors_by_layer(eval_report: dict | None, calib_report: dict | None, path: Path) -> Path | None:
    """eval's relative error of the hidden states after each layer (it accumulates with depth)
    and, for calibrated outputs, each layer's own output error during calibration."""
    if not available():
        return None
    series = []
    if eval_report:
        xy = [(e["layer"], e["rel_error"]) for e in eval_report.get("layers", [])
              if isinstance(e.get("rel_error"), (int, float))]
        if xy:
            series.append(("hidden states after the layer (eval, held-out text)", xy, "o-"))
    if calib_report:
        xy = [(e["layer"], e["output_rel_error"]) for e in calib_report.get("layers", [])
              if isinstance(e.get("output_rel_error"), (int, float))]
        if xy:
            series.append(("the layer's own output (calibration tokens)", xy, "s--"))
    if not series:
        return None
    fig, ax = _figure()
    for label, xy, style in series:
        ax.plot([x for x, _ in xy], [max(y, 1e-12) for _, y in xy], style, ms=3, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("relative error (L2)")
    ax.set_title("Error by layer, INT4 against the source")
    ax.legend(loc="best", fontsize=8)
    return _save(fig, path)


def routed_tokens(report: dict, path: Path) -> Path | None:
    """A heat map of routed calibration tokens per expert (x) and MoE layer (y), log colour;
    experts that got none (dead) and below --min-expert-tokens (starved) marked."""
    if not available():
        return None
    rows = [(e["layer"], e["expert_tokens"]) for e in report.get("layers", []) if e.get("expert_tokens")]
    if not rows:
        return None
    import numpy as np

    width = max(len(t) for _, t in rows)
    grid = np.full((len(rows), width), np.nan)
    for i, (_, t) in enumerate(rows):
        grid[i, : len(t)] = t
    low = report.get("min_expert_tokens", 0) or 0
    fig, ax = _figure(min(16.0, 4 + width / 16), min(12.0, 2 + len(rows) / 6))
    im = ax.imshow(np.log10(np.maximum(grid, 0) + 1), aspect="auto", interpolation="nearest",
                   cmap="viridis", origin="lower")
    dead = np.argwhere(grid == 0)
    starved = np.argwhere((grid > 0) & (grid < low))
    if len(dead):
        ax.scatter(dead[:, 1], dead[:, 0], marker="x", c="red", s=12, label=f"dead ({len(dead)})")
    if len(starved):
        ax.scatter(starved[:, 1], starved[:, 0], marker="o", facecolors="none", edgecolors="orange",
                   s=14, label=f"< {low} tokens ({len(starved)})")
    ax.set_yticks(range(len(rows)), [str(L) for L, _ in rows] if len(rows) <= 40 else None)
    if len(rows) > 40:
        ax.set_yticks([])
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title("Routed calibration tokens per expert")
    cb = fig.colorbar(im, ax=ax)
    cb.set_label("log10(tokens + 1)")
    if len(dead) or len(starved):
        ax.legend(loc="upper right", fontsize=8)
    return _save(fig, path)

