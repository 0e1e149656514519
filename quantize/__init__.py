"""Stream FP8 / BF16 GLM mixture-of-experts checkpoints into compressed-tensors INT4.

The stages, in the order `pipeline.convert` runs them:

    names.py        every file name of a checkpoint folder (index, manifest, reports, pictures)
    checkpoint.py   read: index, safetensors headers, validation, lazy tensor reads
    source.py       a unit's source tensors, FP8 dequantized; the compute device
    layout.py       which tensors are quantization targets, the engines' ignore list
    plan.py         the exact output tensors, shards and bytes, from headers alone
    fp8.py          FP8 -> float dequantization (block and per-channel)
    int4.py         group-wise INT4 round-to-nearest, pack/unpack (pack-quantized)
    qconfig.py      config.json's quantization_config (compressed-tensors' classes)
    calib_data.py   calibration text (default set in calib_data/) -> token ids   [--method != rtn]
    layers.py       decoder layers from transformers' classes, filled and run      [--method != rtn]
    capture.py      the MLP's calibration forward and its statistics (Hessians)    [--method != rtn]
    folds.py        where AWQ's MLP-input scale goes: the norm found on the layer   [awq]
    rounding.py     one layer's MLP rounded from its statistics (AWQ, GPTQ, RTN)   [--method != rtn]
    calib_layer.py  one layer's calibration: load, pass 1, rounding, RTN guard, pass 2 [--method != rtn]
    calib_mtp.py    the MTP layer's real inputs and its config                 [--method != rtn]
    calibrate.py    the loop on the layer thread (_run_layers), resume, report  [--method != rtn]
    handoff.py      each layer's result handed to the writer as a value (LayerResult) [--method != rtn]
    calib_state.py  layer-boundary checkpoints of the calibration, for resume     [--method != rtn]
    distributed.py  several processes under torchrun: samples and experts per rank [torchrun]
    shards.py       write: streamed safetensors shards, index, config, atomic renames
    pipeline.py     the recipe: validate, plan, stream units, write, finish
    verify.py       reload the output and compare it with the source
    layercheck.py   verify's function check: each layer of output and source, against RTN's
    int4view.py     an output folder read as float weights (verify's layers, eval)
    evaluate.py     perplexity / KL of the output against the source, layer by layer  [eval]
"""

__version__ = "0.1.0"
# The layout of every JSON this tool writes or prints (reports, manifest, --json output):
# raised when a key changes meaning or goes away. Non-finite numbers are written as null.
SCHEMA_VERSION = 1
