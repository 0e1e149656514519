"""`quantize convert`'s own parameters: their types, help texts and defaults' reasons (the
options several commands share are params.py's)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from quantize.cli.params import CALIB, ExpertCalibration, Method, Recipe, more, recipe_callback
from quantize.cli.run_record import config_callback, from_callback
from quantize.options import MAX_EXPERT_COVERAGE

ConvertSrc = Annotated[str | None, typer.Argument(
    help="Source checkpoint: a folder or a Hub repo id org/name (with --from: default the "
         "recorded one).", show_default=False)]
ConvertDst = Annotated[Path | None, typer.Argument(
    help="Output folder for the INT4 checkpoint.", show_default=False)]
RecipeOpt = Annotated[Recipe | None, typer.Option(
    "--recipe", is_eager=True, callback=recipe_callback, show_default=False,
    help="recommended: --method gptq --num-samples 512 --seq-len 2048 (flags win).")]
MethodOpt = Annotated[Method, typer.Option(
    help="Rounding: rtn (no data, minutes), gptq (recommended), awq or awq+gptq.")]
CalibOpt = Annotated[str | None, typer.Option(
    help="Calibration text: .jsonl (text or chat messages), .txt, .parquet (also .xz/.gz), "
         "a datasets folder or a Hub dataset ORG/NAME@REV:SPLIT. Default: shipped:large, "
         "1.8 M tokens of dialogue, docs, code and math (enough for 512 x 2048).",
    rich_help_panel=CALIB)]
NumSamples = Annotated[int, typer.Option(
    help="Calibration sequences (recommended: 512).", rich_help_panel=CALIB)]
SeqLen = Annotated[int, typer.Option(
    help="Tokens per calibration sequence.", rich_help_panel=CALIB)]
Seed = Annotated[int, typer.Option(
    help="Seed for sampling the calibration windows.", **more())]
CalibBos = Annotated[bool, typer.Option(
    "--calib-bos/--no-calib-bos",
    help="Begin each calibration window with the tokens every served request begins with: "
         "the tokenizer's BOS (Gemma, Llama), else the special tokens the chat template "
         "writes first (GLM's [gMASK]<sop>). Off: windows cut from the text alone, as "
         "before 2026-12-05.",
    **more())]
ExpertCalibrationOpt = Annotated[ExpertCalibration, typer.Option(
    help="routed: each expert's statistics from its routed tokens; routed-weighted: those "
         "tokens weighted by their squared routing weight (as the layer output weighs the "
         "expert's error; not measured on real weights: BENCHMARKS.md); all: every expert "
         "sees every token (llm-compressor's way).", **more())]
MinExpertTokens = Annotated[int, typer.Option(
    help="Experts whose statistics cover fewer tokens use all-token statistics (reported).",
    **more())]
ExpertCoverage = Annotated[int, typer.Option(
    min=0, max=MAX_EXPERT_COVERAGE,
    help="Top up each routed expert's statistics to this many tokens: an expert routed fewer "
         "gets the tokens its router ranks highest among the rest (reported; 0: off; "
         "held on the device in each layer's first pass: GLM-5.2 at 256, 0.8 GB).",
    **more())]
Percdamp = Annotated[float, typer.Option(
    help="GPTQ dampening, relative to the mean Hessian diagonal (0.01, the papers' value, "
         "overfits narrow calibration text: BENCHMARKS.md).", **more())]
RtnFallback = Annotated[bool, typer.Option(
    help="A calibrated layer whose output error on the calibration tokens exceeds "
         "round-to-nearest's by 1.5x stops the run by default; with this flag that layer is "
         "rounded to nearest instead (the calibration report and the card list it).",
    **more())]
CheckpointInterval = Annotated[float, typer.Option(
    help="Seconds between the calibration's resume checkpoints, at least (written in the "
         "background; a crash repeats about this much work; 0: after every layer; inf: "
         "none, a crash restarts the calibration).", **more())]
MaxGpuMemory = Annotated[float | None, typer.Option(
    help="GiB of GPU memory the calibration may hold (default: all of it); 75 runs GLM-5.2 "
         "as on an 80 GB GPU.", rich_help_panel=CALIB)]
ResumeOpt = Annotated[bool, typer.Option(
    "--resume", help="Continue an interrupted conversion (automatic when DST has a manifest).")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Delete DST's contents and start over.")]
BaseModel = Annotated[str | None, typer.Option(**more(),
    help="The Hub repo SRC is a copy of (ORG/NAME), for the card's base_model; default: the "
         "repo a Hub-cache source came from. Pass it for a local copy, e.g. after "
         "`hf download --local-dir`.")]
JsonSummary = Annotated[bool, typer.Option(
    "--json", help="Print a JSON summary on stdout at the end.")]
ConfigOpt = Annotated[Path | None, typer.Option(
    "--config", is_eager=True, callback=config_callback, exists=False, **more(),
    help="A TOML file of convert options (keys as the long flags; flags given on the "
         "command line win), e.g. a run record DST/quantize-run.toml.")]
FromOpt = Annotated[Path | None, typer.Option(
    "--from", is_eager=True, callback=from_callback, **more(),
    help="Replay the run that made this output folder: its options (and SRC) from its "
         "quantize-run.toml; flags given here win.")]
