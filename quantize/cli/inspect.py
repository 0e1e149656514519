"""`quantize inspect`: what a checkpoint holds, from headers only."""

from __future__ import annotations

from quantize.cli.app import app, out, print_json
from quantize.cli.params import Debug, Json, Revision, Src


@app.command()
def inspect(src: Src, revision: Revision = None, json_: Json = False, debug: Debug = False) -> None:
    """What a checkpoint holds: format, layers, experts, bytes by category.

    Reads config.json, the index and the safetensors headers (and an output's manifest), from a
    folder or the Hub; never the weights.

    Examples:
      quantize inspect ./GLM-5.2-FP8
      quantize inspect zai-org/GLM-5.2-FP8       # Hub: config + safetensors headers, no weights
      quantize inspect ./GLM-5.2-INT4            # an INT4 output: scheme, INT4 Linears, bytes
    """
    from quantize.cli.report import (
        inspect_data,
        inspect_int4_data,
        inspect_int4_table,
        inspect_table,
        int4_folder,
    )
    from quantize.source.hub import resolve_source

    if int4_folder(src):  # our own output (or any pack-quantized folder)
        d = inspect_int4_data(src)
        print_json(d) if json_ else out.print(inspect_int4_table(d))
        return
    d = inspect_data(resolve_source(src, revision, headers_only=True))
    print_json(d) if json_ else out.print(inspect_table(d))
