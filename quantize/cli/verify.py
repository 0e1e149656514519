"""`quantize verify`: every output tensor against the source, then every layer; verify.json."""

from __future__ import annotations

from typing import Annotated

import typer

from quantize.cli.app import app, err, out, print_json, progress, reporters, tag
from quantize.cli.params import Debug, Device, Dst, Json, Revision, Src


@app.command()
def verify(
    src: Src,
    dst: Dst,
    min_sqnr: Annotated[float, typer.Option(help="Fail when an INT4 tensor's SQNR (dB) is below this.")] = 12.0,
    device: Device = "auto",
    layer_check: Annotated[bool, typer.Option(
        "--layer-check/--no-layer-check",
        help="Also run every decoder layer of the source and of the output on the same 256 "
             "tokens' hidden states and fail a layer whose output error exceeds 3x "
             "round-to-nearest's (push refuses a report without it).")] = True,
    json_: Json = False,
    revision: Revision = None,
    debug: Debug = False,
) -> None:
    """Reload every output tensor and compare it with the source; write DST/verify.json.

    INT4 tensors: relative error and SQNR against the dequantized source; everything else must
    be bit-identical (or the exact BF16 dequant of its FP8 source); index, config, shapes and
    the manifest's checksums must agree. Then the function: each decoder layer of the output,
    as written, against the source's on the same hidden states, bounded by round-to-nearest's
    error (a wrong AWQ fold passes every weight check and fails this). Exit 1 when any check fails.

    Examples:
      quantize verify ./GLM-5.2-FP8 ./GLM-5.2-INT4
      quantize verify ./GLM-5.2-FP8 ./GLM-5.2-INT4 --min-sqnr 15 --json
      quantize verify ./GLM-5.2-FP8 ./GLM-5.2-INT4 --no-layer-check   # tensors only
    """
    from quantize.check.verify import verify as run_verify
    from quantize.cli.report import verify_table
    from quantize.source.hub import resolve_source
    from quantize.write.manifest import finished_manifest

    finished_manifest(dst)  # an unfinished DST is said before SRC is resolved (or downloaded)
    local = resolve_source(src, revision, headers_only=False)
    with progress() as bar:
        step, line = reporters(bar, "verify")
        line(f"verify {src} against {dst}")
        rep = run_verify(local, dst, min_sqnr, device, on_start=step.start, on_unit=step,
                         layer_check=layer_check, log=line)
    if json_:
        print_json(rep.to_json()["summary"])
    else:
        out.print(verify_table(rep))
    for n in rep.notes:
        err.print(tag("note:", "yellow"), f"{n}", highlight=False)
    for p in rep.problems:
        err.print(tag("problem:", "red"), f"{p}", highlight=False)
    failed = [t for t in rep.tensors if not t.ok]
    for t in failed[:50]:  # one line per failed tensor, what failed and by how much
        err.print(tag("fail:", "red"), f"{t.name}: {t.note or 'check failed'} (relative error "
                  f"{t.rel_err:.4g}, SQNR {t.sqnr_db:.4g} dB; floor {min_sqnr:g} dB)", highlight=False)
    if len(failed) > 50:
        err.print(f"... and {len(failed) - 50} more failed tensors (verify.json)", highlight=False)
    if not rep.ok:
        raise typer.Exit(1)
