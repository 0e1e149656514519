"""Stream FP8 / BF16 GLM mixture-of-experts checkpoints into compressed-tensors INT4.

Folders by job; the stages in the order `pipeline.convert` runs them:

    names.py  errors.py  options.py    every file name of a folder; the user's errors; the options
    plan.py  lint.py  disk.py          the exact output from headers alone; known-bad layouts; disk
    overlap.py                         work beside the stream: a value built on a thread, the
                                       page cache read ahead of the reads (Readahead)
    source/      read the source       checkpoint.py (index, headers, validation, lazy reads),
                                       hub.py, layout.py (roles, ignore list), fp8.py, staging.py
                                       (pinned copies), weights.py (a unit's tensors as float, the
                                       compute device), synth.py (synthetic release checkpoints)
    rounding/    the math, no I/O      int4.py (RTN, pack-quantized), gptq.py (+ gptq_triton.py),
                                       awq.py
    calib/       --method != rtn       data.py (calibration text -> token ids), decoder.py
                                       (transformers' layers, built, filled, run), loop.py (THE
                                       layer loop: Calibrator._run_layers), layer.py (one layer:
                                       load, rounding, RTN guard), passes.py (its forwards: pass 1,
                                       pass 2), capture.py (statistics), round_layer.py (GPTQ / RTN
                                       of one MLP), round_awq.py (AWQ's search and fold), folds.py
                                       (where AWQ's scale goes), fold_probe.py (the fold proven up
                                       front), mtp.py, handoff.py (results to the writer
                                       as values), state.py + resume.py (checkpoints, resume),
                                       distributed.py (torchrun ranks)
    write/       the output            shards.py (streamed, atomic), manifest.py, qconfig.py
    pipeline.py                        the recipe: validate, plan, stream units, write, finish
    check/       prove it              verify.py + layercheck.py + int4view.py, evaluate.py (eval)
    publish/     the Hub               readme.py + card.py (model card), plots.py, push.py
    cli/         one file per command on app.py (the one place errors become exit 2), report.py
"""

__version__ = "0.1.0"
# The layout of every JSON this tool writes or prints (reports, manifest, --json output):
# raised when a key changes meaning or goes away. Non-finite numbers are written as null.
SCHEMA_VERSION = 1
