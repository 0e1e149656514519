"""Every file name this tool reads or writes in a checkpoint folder, in one place.

Inputs and outputs alike (an output folder is a checkpoint too):

    model.safetensors.index.json     INDEX_NAME: the weight map (a sharded checkpoint)
    model.safetensors                SINGLE_NAME: an unsharded checkpoint's one file
    quantize-manifest.json           MANIFEST: every written file's bytes and sha256, the options
    quantize-run.toml                RUN_RECORD: convert's resolved options (local, never pushed)
    README.md                        CARD: the model card
    calibration-report.json          CALIB_REPORT: what a calibrated run did, per layer (checksummed)
    calibration/timings.json         CALIB_TIMINGS: its wall times and memory peaks (not checksummed)
    calibration/awq-scales.safetensors  AWQ_SCALES: the AWQ scales as applied, and each norm fold
    calibration/state/               CALIB_STATE: resume checkpoints of an unfinished calibrated run
    verify.json                      VERIFY_JSON: verify's report
    eval.json                        EVAL_JSON: eval's report
    PICTURES                         the pictures verify, eval and a calibrated convert draw
"""

from __future__ import annotations

__all__ = [
           "AWQ_SCALES",
           "CALIB_REPORT",
           "CALIB_STATE",
           "CALIB_TIMINGS",
           "CARD",
           "EVAL_JSON",
           "INDEX_NAME",
           "LAYERS_PICTURE",
           "MANIFEST",
           "PICTURES",
           "ROUTED_PICTURE",
           "RUN_RECORD",
           "SINGLE_NAME",
           "SQNR_PICTURE",
           "VERIFY_JSON",
           "WEIGHT_SUFFIXES",
           "partial_name",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MANIFEST = "quantize-manifest.json"
RUN_RECORD = "quantize-run.toml"
CARD = "README.md"
CALIB_REPORT = "calibration-report.json"
CALIB_TIMINGS = "calibration/timings.json"
AWQ_SCALES = "calibration/awq-scales.safetensors"
CALIB_STATE = "calibration/state"
VERIFY_JSON = "verify.json"
EVAL_JSON = "eval.json"
# name in the folder -> what it shows (the card's caption)
SQNR_PICTURE = "verify-sqnr.png"  # verify draws it; verify.json names its sha256
LAYERS_PICTURE = "eval-layers.png"  # eval draws it; eval.json names its sha256
ROUTED_PICTURE = "calibration/routed-tokens.png"  # convert draws it; verify.json names its sha256
PICTURES = {
    SQNR_PICTURE: "SQNR of every INT4 tensor against its source, by layer",
    LAYERS_PICTURE: "error of the hidden states after each layer (eval) and of each layer's "
                    "output during calibration",
    ROUTED_PICTURE: "calibration tokens routed to each expert, by layer "
                    "(dead and starved experts marked)",
}
# weight files of any framework: an output folder holds none the manifest does not list
# the suffix of a file being written (renamed into place when complete)
PARTIAL = ".partial"
NAME_MAX = 255  # bytes in one file name on Linux file systems (ext4, xfs, btrfs, NFS)


def partial_name(name: str) -> str:
    """The temporary name `name` is written under: NAME.partial, or, where that would pass the
    file system's NAME_MAX (a legal 250-byte name), a fixed name from its sha256."""
    import hashlib

    if len((name + PARTIAL).encode()) <= NAME_MAX:
        return name + PARTIAL
    return "long-" + hashlib.sha256(name.encode()).hexdigest()[:32] + PARTIAL
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
