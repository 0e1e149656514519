"""`quantize eval`: perplexity, KL and agreement of the output against its source; eval.json."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from quantize.cli.app import app, err, out, print_json, tag
from quantize.cli.params import Debug, Device, EvalDtype, Json, Revision, Src, value


@app.command("eval")
def eval_(
    src: Src,
    dst: Annotated[Path, typer.Argument(help="A finished `quantize convert` output folder.")],
    data: Annotated[str | None, typer.Option(
        help="Eval text (.jsonl, .txt/.md, .parquet or a saved datasets folder, or shipped:NAME). "
             "Default: shipped:large, the sixth of the default calibration set's documents that no "
             "calibration on a shipped set reads (every genre in it); shipped:small scores the "
             "same sixth of the small set (its first 324 documents).")] = None,
    num_samples: Annotated[int, typer.Option(help="Eval windows.")] = 16,
    seq_len: Annotated[int, typer.Option(
        help="Tokens per window (capped to max_position_embeddings).")] = 2048,
    ood: Annotated[str | None, typer.Option(
        help="Out-of-domain text scored beside --data, to show overfitting to the calibration "
             "text (any format --data reads; 'none' to skip). Default: the shipped general-English "
             "calib_data/heldout_english.md, in no calibration set.")] = None,
    ood_samples: Annotated[int, typer.Option(help="Out-of-domain windows, at most.")] = 4,
    seed: Annotated[int, typer.Option(help="Seed for shuffling the held-out documents.")] = 0,
    bos: Annotated[bool, typer.Option(
        "--bos/--no-bos",
        help="Begin each window with the tokens every served request begins with (the "
             "tokenizer's BOS: Gemma, Llama; else the chat template's first special tokens: "
             "GLM's [gMASK]<sop>); they are not scored. Off: windows of the text alone "
             "(eval.json before 2026-12-05).")] = True,
    device: Device = "auto",
    dtype: Annotated[EvalDtype, typer.Option(
        help="auto: bfloat16 on a GPU, float32 on the CPU.")] = EvalDtype.auto,
    max_ppl_ratio: Annotated[float, typer.Option(
        help="The output is broken (exit 1; push refuses it) when quantized / source perplexity "
             "exceeds this on the held-out or the out-of-domain text.")] = 2.0,
    max_kl: Annotated[float, typer.Option(
        help="... or when the mean per-token KL(source || quantized), in nats, exceeds this.")] = 1.0,
    json_: Json = False,
    revision: Revision = None,
    debug: Debug = False,
) -> None:
    """Measure DST against its source SRC on held-out text; write DST/eval.json.

    Runs both models side by side one decoder layer at a time (memory: one layer plus the
    hidden states), then reports source and quantized perplexity, their ratio, the mean
    per-token KL(source || quantized), top-1 agreement, and each layer's hidden-state error.
    Windows under the conversion's calibration are held out. The same figures on out-of-domain
    text (general English in no calibration set) follow: a method fitted too closely to its
    calibration text worsens them first. The model card shows the summary.

    Examples:
      quantize eval ./GLM-5.2-FP8 ./GLM-5.2-INT4
      quantize eval ./GLM-5.2-FP8 ./GLM-5.2-INT4 --data held-out.jsonl --num-samples 64
      quantize eval ./GLM-4.6-FP8 ./GLM-4.6-INT4 --max-ppl-ratio 1.05 --json
      quantize eval ./GLM-5.2-FP8 ./GLM-5.2-INT4 --max-kl 0.5
      quantize eval ./GLM-5.2-FP8 ./GLM-5.2-INT4 --ood my-other-domain.txt   # or --ood none
      quantize eval ./GLM-5.2-FP8 ./GLM-5.2-INT4 --no-bos   # windows of text alone, as before 2026-12-05
    """
    from quantize.check.evaluate import EvalOptions, evaluate
    from quantize.cli.report import eval_tables
    from quantize.source.hub import resolve_source

    opts = EvalOptions(data=data, num_samples=num_samples, seq_len=seq_len, seed=seed,
                       dtype=value(dtype), ood=ood, ood_samples=ood_samples,
                       max_ppl_ratio=max_ppl_ratio, max_kl=max_kl, bos=bos)
    local = resolve_source(src, revision, headers_only=False)
    rep = evaluate(local, dst, opts, device=device,
                   log=lambda text: err.print(text, highlight=False, markup=False))
    if json_:
        print_json(rep)
    else:
        for t in eval_tables(rep):
            out.print(t)
    v = rep["verdict"]
    if not v["ok"]:
        err.print(tag("fail:", "red"), f"the output is broken: {'; '.join(v['failed'])} (eval.json; push "
                  "refuses it)", highlight=False)
        raise typer.Exit(1)
