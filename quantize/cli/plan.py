"""`quantize plan`: the output's exact size, per-GPU memory and the serving kernels' checks."""

from __future__ import annotations

from typing import Annotated

import typer

from quantize.cli.app import app, err, out, print_json, tag
from quantize.cli.params import (
    Asym,
    Debug,
    GptaqOpt,
    GroupSize,
    HelpAll,
    Json,
    KeepFp8,
    MaxShardSize,
    Method,
    MseClipOpt,
    MseNormOpt,
    MseNormRoutedOpt,
    MseWeightPowerOpt,
    MseWeightPowerRoutedOpt,
    Mtp,
    MtpOpt,
    Revision,
    ScaleRefitOpt,
    Scheme,
    SchemeOpt,
    SequentialOpt,
    Src,
    Targets,
    Tp,
    convert_options,
)


@app.command()
def plan(
    src: Src,
    tp: Tp = 8,
    group_size: GroupSize = 32,
    targets: Targets = "routed",
    asymmetric: Asym = False,
    max_shard_size: MaxShardSize = "5GB",
    method: Annotated[Method, typer.Option(
        help="Calibrated methods add their resume checkpoints to the disk needed.")] = Method.rtn,
    scheme: SchemeOpt = Scheme.w4a16,
    mtp: MtpOpt = Mtp.int4,
    keep_fp8: KeepFp8 = False,
    num_samples: Annotated[int, typer.Option(help="Calibration sequences (calibrated methods).")] = 128,
    seq_len: Annotated[int, typer.Option(help="Tokens per calibration sequence.")] = 2048,
    mse_clip: MseClipOpt = None,
    mse_norm: MseNormOpt = None,
    mse_weight_power: MseWeightPowerOpt = None,
    mse_norm_routed: MseNormRoutedOpt = None,
    mse_weight_power_routed: MseWeightPowerRoutedOpt = None,
    gptaq: GptaqOpt = None,
    scale_refit: ScaleRefitOpt = None,
    sequential_mlp: SequentialOpt = None,
    gpu_memory: Annotated[str, typer.Option(
        help="GPU for the KV-cache room: h100, h200, b200 or its memory (141GB, 143771MiB).")] = "h200",
    mem_fraction: Annotated[float | None, typer.Option(
        help="The engine's share of GPU memory for weights + KV cache (SGLang's "
             "--mem-fraction-static; default: SGLang's own rule for the GPU and TP).",
        min=0.05, max=1.0)] = None,
    json_: Json = False,
    strict: Annotated[bool, typer.Option(help="Exit 1 when a serving check fails.")] = False,
    revision: Revision = None,
    debug: Debug = False,
    help_all: HelpAll = False,
) -> None:
    """Predict the output size, per-GPU weight memory and KV-cache room; check the serving kernels' rules.

    Reads only the index and safetensors headers. The prediction is the exact byte count
    `convert` writes.

    Examples:
      quantize plan ./GLM-5.2-FP8 --tp 8
      quantize plan ./GLM-5.2-FP8 --tp 8 --gpu-memory h100    # KV-cache room on 80 GB cards
      quantize plan ./GLM-4.6-FP8 --tp 8 --group-size 128     # warns: 1536/8 = 192
      quantize plan zai-org/GLM-5.2-FP8 --tp 8                # Hub: headers only
      quantize plan ./GLM-5.2-FP8 --method gptq --num-samples 512   # + checkpoint disk
      quantize plan ./GLM-5.2-FP8 --method gptq --targets routed,shared   # GPTAQ: x2 checkpoints
      quantize plan ./GLM-5.2-FP8 --method gptq --mse-weight-power-routed 0   # how the scales are chosen
      quantize plan ./GLM-5.2-INT4 --tp 8        # an INT4 output: the serving checks at TP 8
    """
    from quantize.cli.report import (
        inspect_int4_data,
        inspect_int4_table,
        int4_folder,
        plan_data,
        plan_tables,
    )
    from quantize.kvcache import gpu_bytes
    from quantize.plan import make_plan
    from quantize.source.hub import resolve_source

    if int4_folder(src):  # an INT4 output: where it can be served, nothing left to plan
        d = inspect_int4_data(src, tp)
        checks, prefix = d["checks_at_tp"]["checks"], f"TP {tp}: "
        if json_:
            print_json(d)
        else:
            out.print(inspect_int4_table(d))
            for c in checks:
                out.print(f"TP {tp}: {c['level']:4}  {c['what']}: {c['detail']}", highlight=False)
    else:
        ckpt = resolve_source(src, revision, headers_only=True)
        d = plan_data(make_plan(ckpt, convert_options(
            method, group_size, targets, asymmetric, max_shard_size, num_samples=num_samples,
            seq_len=seq_len, scheme=scheme, mtp=mtp, keep_fp8=keep_fp8, mse_clip=mse_clip,
            mse_norm=mse_norm, mse_weight_power=mse_weight_power, mse_norm_routed=mse_norm_routed,
            mse_weight_power_routed=mse_weight_power_routed, gptaq=gptaq,
            scale_refit=scale_refit, sequential_mlp=sequential_mlp), tp),
            gpu_bytes(gpu_memory), mem_fraction, ckpt.config)
        checks, prefix = d["checks"], ""
        if json_:
            print_json(d)
        else:
            for t in plan_tables(d):
                out.print(t)
    failed = [c for c in checks if c["level"] == "fail"]
    for c in failed:
        err.print(tag("warning:", "yellow"), f"{prefix}{c['what']}: {c['detail']}", highlight=False)
    if failed and strict:
        raise typer.Exit(1)
