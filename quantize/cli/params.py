"""The parameters several commands share: their types, help texts and choices, and the
options object built from them."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from quantize.options import EXPERT_CALIBRATION, METHODS, MTP_POLICIES, SCHEMES


def _choices(name: str, values: tuple[str, ...]) -> type[Enum]:
    """A str Enum of the values options.py validates (one list: --help shows exactly those)."""
    return Enum(name, {v.replace("+", "_").replace("-", "_"): v for v in values}, type=str)


Method = _choices("Method", METHODS)
Scheme = _choices("Scheme", SCHEMES)
Mtp = _choices("Mtp", MTP_POLICIES)
ExpertCalibration = _choices("ExpertCalibration", EXPERT_CALIBRATION)


# named presets of convert's options (`--recipe`): what each sets unless given as a flag too
RECIPES = {"recommended": {"method": "gptq", "num_samples": 512, "seq_len": 2048}}
Recipe = _choices("Recipe", tuple(RECIPES))


def recipe_callback(ctx: typer.Context, value) -> None:
    """--recipe NAME: its options become this run's defaults (a flag given still wins)."""
    if value is not None:
        ctx.default_map = {**(ctx.default_map or {}), **RECIPES[getattr(value, "value", value)]}
    return value


class EvalDtype(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"


def value(x):
    """An Enum choice's string (anything else as it is)."""
    return x.value if isinstance(x, Enum) else x


# `--help-all` on the command line shows every option; plain --help hides the research
# settings and the rarely changed output options (they work the same) behind one line
SHOW_ALL = "--help-all" in sys.argv[1:]
MORE = "More options"


def more(**kw) -> dict:
    """typer.Option arguments of an option --help shows only with --help-all."""
    return {"hidden": not SHOW_ALL, "rich_help_panel": MORE, **kw}


HelpAll = Annotated[bool, typer.Option(
    "--help-all", is_eager=True, help="Show every option (research settings included) and exit.",
    callback=lambda ctx, v: (typer.echo(ctx.get_help()), ctx.exit()) if v else None)]
MseClipOpt = Annotated[bool | None, typer.Option(
    "--mse-clip/--no-mse-clip", help="GPTQ: search each group's clipping range (1.00-0.80 of "
    "min/max) for the least Hessian-weighted error (power --mse-norm) instead of the full range. "
    "Default: on for gptq and awq+gptq (largest where weights sit near a 4-bit grid, "
    "smaller off it: README; on CUDA one Triton kernel, under 1 s per GLM-5.2 MoE layer).",
    show_default=False, **more())]
MseNormOpt = Annotated[int | None, typer.Option(
    help="The MSE clip's error power N, sum H_kk^A |w - q|^N: 3 clips less than 2. Default: "
         "2 at --group-size 32, 3 at 64 and 128 (each group size's best on Gemma-3-270M, "
         "weights off a 4-bit grid: BENCHMARKS.md) on dense and shared-expert Linears; "
         "routed experts: --mse-norm-routed. A value given applies to every target.",
    min=2, max=3, show_default=False, **more())]
MseWeightPowerOpt = Annotated[float | None, typer.Option(
    help="The MSE clip's weight on each input channel, H_kk^A (H_kk: its mean squared "
         "activation): 1 weighs the error as the layer's output does, 0 weighs every channel "
         "alike. Default: 0 at --group-size 32 (less perplexity added out of domain there), "
         "1 at 64 and 128 (less at 128: BENCHMARKS.md), on dense and shared-expert Linears; "
         "routed experts: --mse-weight-power-routed. A value given applies to every target.",
    min=0.0, max=1.0, show_default=False, **more())]
MseNormRoutedOpt = Annotated[int | None, typer.Option(
    help="--mse-norm for routed experts. Default: --mse-norm's value where given, else 3 at "
         "every group size.", min=2, max=3, show_default=False, **more())]
MseWeightPowerRoutedOpt = Annotated[float | None, typer.Option(
    help="--mse-weight-power for routed experts. Default: --mse-weight-power's value where "
         "given, else 1 at every group size (the unweighted clip raised the held-out KL on "
         "the tiny GLM MoE models, whose norms carry outlier channels: BENCHMARKS.md).",
    min=0.0, max=1.0, show_default=False, **more())]
ScaleRefitOpt = Annotated[int | None, typer.Option(
    help="GPTQ: rounds of re-fitting each row's group scales by least squares to the chosen "
         "codes against the Hessian (1: the codes stay; more: the column loop runs again under "
         "the re-fitted scales). 0: off. Default: 3 on dense and shared-expert Linears and 0 on "
         "routed experts (lower KL on Gemma-3-270M with GPTAQ; 8.5x the time of a GLM-5.2 MoE "
         "layer: BENCHMARKS.md); a number given applies to every target.",
    min=0, max=8, show_default=False, **more())]
GptaqOpt = Annotated[float | None, typer.Option(
    help="GPTQ with asymmetric calibration (GPTAQ): dense and shared-expert Linears fit the "
         "unrounded model's outputs instead of the unrounded layer's on the rounded model's "
         "inputs; the fraction of that correction taken, 0 (off) to 1. Where such a Linear is a "
         "target it carries a second copy of the calibration's hidden states (their memory and "
         "checkpoints x2) and runs each layer on it too; routed experts keep plain GPTQ. "
         "Default for gptq and awq+gptq: 0.5 at --group-size 32, 0.375 at 64 and 128 (the "
         "lowest KL on Gemma-3-270M with each group size's clip; 0.75 and 1 overshoot: "
         "BENCHMARKS.md).",
    min=0.0, max=1.0, show_default=False, **more())]


SchemeOpt = Annotated[Scheme, typer.Option(
    "--scheme", **more(), help="w4a16: INT4 weights, BF16 activations (Marlin/WNA16). w4afp8: the same INT4 "
                     "weights with dynamic per-token FP8 activations declared (CUTLASS W4A8 MoE on "
                     "Hopper; needs --group-size 128, symmetric; plan says which TP sizes work).")]
KeepFp8 = Annotated[bool, typer.Option(
    "--keep-fp8", **more(), help="Keep the non-target FP8 Linears FP8 with their scales (a second, "
                       "float-quantized config group; vLLM reads mixed-precision, SGLang does "
                       "not) instead of widening them to BF16: GLM-5.2 404.3 GiB instead of 419.9.")]
MtpOpt = Annotated[Mtp, typer.Option(
    "--mtp", **more(), help="The MTP (speculative decoding) layer's --targets Linears: int4 like the "
                  "decoder layers' (the default: the write-up's layout, 419.9 GiB for GLM-5.2), "
                  "or keep them as in the source (BF16; plan --mtp keep gives the size). Serving with MTP speculative "
                  "decoding? Prefer keep: published runs saw an INT4 MTP head collapse the draft "
                  "acceptance rate (not measured here: no GLM MTP weights on our machines).")]
Src = Annotated[str, typer.Argument(
    help="Source checkpoint: a folder (config.json + safetensors) or a Hub repo id org/name.")]
Revision = Annotated[str | None, typer.Option(
    "--revision", help="Hub source only: branch, tag or commit to read (default: main).")]
Dst = Annotated[Path, typer.Argument(help="Output folder for the INT4 checkpoint.")]
GroupSize = Annotated[int, typer.Option("--group-size", "-g", help="INT4 group size: 32, 64 or 128.")]
Targets = Annotated[str, typer.Option(
    "--targets", help="Comma list of Linear roles to quantize: routed, shared, dense.")]
Asym = Annotated[bool, typer.Option(
    "--asymmetric", **more(), help="Store zero points (vLLM Marlin reads them; SGLang MoE and transformers do not).")]
Tp = Annotated[int, typer.Option("--tp", help="Tensor-parallel size to check the layout against.",
                                  min=1, max=1024, **more())]
Json = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]
Debug = Annotated[bool, typer.Option("--debug", help="Show full tracebacks.")]
Device = Annotated[str, typer.Option(help="auto (GPU when present), cpu or cuda[:N].")]
MaxShardSize = Annotated[str, typer.Option(help="Largest output shard, e.g. 5GB, 512MiB.", **more())]
CALIB = "Calibration (gptq, awq)"  # the --help panel of the calibration's options
SequentialOpt = Annotated[bool | None, typer.Option(
    "--sequential-mlp/--no-sequential-mlp",
    help="GPTQ: in a dense or shared-expert MLP, fit down_proj to the activations of the "
         "rounded gate/up (one more pass of gate/up over the calibration tokens), instead of "
         "the unrounded ones; with GPTAQ its correction then includes what rounding gate/up "
         "moved. Routed experts keep the statistics of the first pass. Default: on for gptq "
         "and awq+gptq (Gemma-3-270M: lower KL at groups 32 and 128; BENCHMARKS.md).",
    show_default=False, **more())]


def convert_options(method: str, group_size: int, targets: str, asymmetric: bool,
                    max_shard_size: str = "5GB", **calibration):
    """The ConvertOptions the command line's values mean (validated there, by option name)."""
    from quantize.options import ConvertOptions, parse_size

    calibration = {k: value(v) for k, v in calibration.items()}
    return ConvertOptions(method=value(method), group_size=group_size, symmetric=not asymmetric,
                          targets=frozenset(t.strip() for t in targets.split(",") if t.strip()),
                          max_shard_size=parse_size(max_shard_size), **calibration)
