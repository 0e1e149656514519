"""The catalogue of bad inputs (issue 5), each through the CLI.

Every case must give: exit status 2, one `error:` message naming the file (and the tensor
where there is one), what was found, what was expected and the fix; no traceback; and nothing
in the output folder that could be mistaken for a result (no folder at all when the problem
is visible in the headers; otherwise an `in-progress` manifest, no index or config, and
`verify` refusing it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from quantize.calib.loop import Calibrator
from quantize.cli import app
from quantize.errors import QuantizeError
from quantize.names import AWQ_SCALES, CALIB_REPORT
from quantize.options import ConvertOptions
from quantize.plan import make_plan
from quantize.source.checkpoint import INDEX_NAME, open_checkpoint
from quantize.source.synth import tiny_config, write_checkpoint, write_tokenizer
from quantize.write.manifest import MANIFEST
from quantize.write.shards import sha256_file

runner = CliRunner()


# --- helpers -----------------------------------------------------------------------------------


@pytest.fixture
def src(dsa_fp8, tmp_path) -> Path:
    """A private copy of the tiny GLM-5 block-FP8 checkpoint, to damage."""
    return Path(shutil.copytree(dsa_fp8, tmp_path / "src"))


def convert(src: Path, out: Path, *extra: str, input: str | None = None):
    return runner.invoke(app, ["convert", str(src), str(out), "--device", "cpu", "--tp", "1",
                               *extra], input=input)


def assert_clear_error(r, *must: str) -> str:
    text = r.output
    assert r.exit_code == 2, text
    assert "error:" in text and "Traceback" not in text, text
    assert "(expected " in text and "Fix: " in text, text  # Problem: found, expected, fix
    for m in must:
        assert m in text, f"{m!r} not in:\n{text}"
    print(text)  # shown with `pytest -s`: the catalogue of messages
    return text


def assert_nothing_written(out: Path) -> None:
    assert not out.exists(), sorted(p.name for p in out.iterdir())


def assert_unfinished(src: Path, out: Path) -> None:
    """A run stopped mid-way: nothing an engine or `verify` would take for a checkpoint."""
    assert json.loads((out / MANIFEST).read_text())["status"] == "in-progress"
    assert not (out / INDEX_NAME).exists() and not (out / "config.json").exists()
    assert not list(out.glob("*.partial"))
    r = runner.invoke(app, ["verify", str(src), str(out)])
    assert r.exit_code == 2 and "not a finished conversion" in r.output


def index(src: Path) -> dict:
    return json.loads((src / INDEX_NAME).read_text())


def set_index(src: Path, idx: dict) -> None:
    (src / INDEX_NAME).write_text(json.dumps(idx, indent=2))


def rewrite_shard(src: Path, tensor: str, change) -> str:
    """Load the shard holding `tensor`, apply `change(dict)` and save it back; its file name."""
    fname = index(src)["weight_map"][tensor]
    tensors = load_file(src / fname)
    change(tensors)
    save_file(tensors, src / fname, metadata={"format": "pt"})
    return fname


def poke(src: Path, tensor: str, data: bytes, at: int = 0) -> str:
    """Overwrite bytes of `tensor`'s data in place, `at` bytes in; its shard's file name."""
    info = open_checkpoint(src).tensors[tensor]
    with open(src / info.file, "r+b") as f:
        f.seek(info.begin + at)
        f.write(data)
    return info.file


def set_config(src: Path, **changes) -> None:
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (src / "config.json").write_text(json.dumps(cfg, indent=2))


EXPERT = "model.layers.1.mlp.experts.2.down_proj.weight"  # routed, block FP8, [256, 96]
NORM = "model.layers.0.input_layernorm.weight"  # BF16, copied


# --- shard names that leave the model folder ---------------------------------------------------


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_shard_names_escaping_the_folder(src, tmp_path, how):
    outside = tmp_path / "outside.safetensors"
    shutil.copyfile(src / index(src)["weight_map"][NORM], outside)
    name = {"dotdot": "../outside.safetensors", "absolute": str(outside),
            "symlink": "model-evil.safetensors"}[how]
    if how == "symlink":
        (src / name).symlink_to(outside)
    idx = index(src)
    idx["weight_map"][NORM] = name
    set_index(src, idx)
    says = {"dotdot": "a path that climbs out of the folder", "absolute": "an absolute path",
            "symlink": f"a link that points outside the model folder (to {outside})"}[how]
    for cmd in (["inspect", str(src)], ["plan", str(src)]):
        assert_clear_error(runner.invoke(app, cmd), INDEX_NAME, NORM, says)
    assert_clear_error(convert(src, tmp_path / "out"), INDEX_NAME, NORM, says)
    assert_nothing_written(tmp_path / "out")


def test_non_weight_file_linking_outside_is_refused(src, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    (src / "tokenizer.json").symlink_to(secret)
    text = assert_clear_error(convert(src, tmp_path / "out"), "tokenizer.json", f"a link to {secret}")
    assert "the source links to files outside the model folder" in text
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("name", ["config.json", INDEX_NAME])
def test_config_or_index_linking_outside_is_refused(src, tmp_path, name):
    """config.json and the index are read first, before any shard: a link of theirs that leads
    out of the folder is refused like a shard's, by every command, before anything is written."""
    elsewhere = tmp_path / "elsewhere" / name
    elsewhere.parent.mkdir()
    shutil.move(src / name, elsewhere)  # the same bytes, only reached through a link
    (src / name).symlink_to(elsewhere)
    for cmd in (["inspect", str(src)], ["plan", str(src)]):
        assert_clear_error(runner.invoke(app, cmd), "the source links to files outside the model folder",
                           f"{src / name}: a link to {elsewhere}")
    assert_clear_error(convert(src, tmp_path / "out"), f"{src / name}: a link to {elsewhere}")
    assert_nothing_written(tmp_path / "out")


def test_hugging_face_cache_links_are_accepted(dsa_fp8, tmp_path):
    """`hf download` without --local-dir: every snapshot file links to ../../blobs/<hash>."""
    repo = tmp_path / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for p in sorted(dsa_fp8.iterdir()):
        blob = blobs / sha256_file(p)
        shutil.copyfile(p, blob)
        (snap / p.name).symlink_to(os.path.relpath(blob, snap))
    r = convert(snap, tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out" / "generation_config.json").read_bytes() == \
        (dsa_fp8 / "generation_config.json").read_bytes()


def test_a_source_folder_that_is_itself_a_link_is_fine(dsa_fp8, tmp_path):
    (tmp_path / "model").symlink_to(dsa_fp8)  # e.g. /data/model -> /mnt/nfs/model
    r = convert(tmp_path / "model", tmp_path / "out")
    assert r.exit_code == 0, r.output


# --- missing or damaged files ------------------------------------------------------------------


def test_index_names_a_missing_shard(src, tmp_path):
    fname = index(src)["weight_map"][NORM]
    (src / fname).unlink()
    assert_clear_error(convert(src, tmp_path / "out"), INDEX_NAME, f"shard {fname} does not exist",
                       "download the missing shard")
    assert_nothing_written(tmp_path / "out")


def test_tensor_in_index_absent_from_its_shard(src, tmp_path):
    fname = rewrite_shard(src, NORM, lambda t: t.pop(NORM))
    assert_clear_error(convert(src, tmp_path / "out"), f"{fname} :: {NORM}",
                       "not in this shard's header", "different revisions")
    assert_nothing_written(tmp_path / "out")


def test_truncated_shard(src, tmp_path):
    fname = index(src)["weight_map"][EXPERT]
    p = src / fname
    os.truncate(p, p.stat().st_size - 1000)
    assert_clear_error(convert(src, tmp_path / "out"), "truncated safetensors file", fname,
                       "the download or copy was cut short")
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("damage", ["json", "length", "offsets", "types"])
def test_corrupt_header(src, tmp_path, damage):
    fname = index(src)["weight_map"][EXPERT]
    p = src / fname
    data = bytearray(p.read_bytes())
    n = int.from_bytes(data[:8], "little")
    if damage == "json":
        data[8:16] = b"\x00garbage"
        says = "header is not valid JSON"
    elif damage == "length":
        data[:8] = (2**40).to_bytes(8, "little")
        says = f"header length {2**40} in a {len(data)}-byte file"
    else:  # a header that lies about a tensor's extent
        header = json.loads(data[8:8 + n])
        header[EXPERT]["data_offsets"][1] += 8
        if damage == "types":
            header[EXPERT]["data_offsets"] = ["0", "8"]
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (n - len(raw))
        assert len(raw) == n
        data[8:8 + n] = raw
        says = f"{fname} :: {EXPERT}: " + ("entry {" if damage == "types" else "data_offsets")
    p.write_bytes(bytes(data))
    assert_clear_error(convert(src, tmp_path / "out"), fname, says, "re-download this shard")
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("text", ["[1, 2]", '{"quantization_config": "fp8"}'])
def test_config_that_is_not_a_config(src, tmp_path, text):
    (src / "config.json").write_text(text)
    assert_clear_error(convert(src, tmp_path / "out"), "config.json is not a model config",
                       "a JSON object")
    assert_nothing_written(tmp_path / "out")


# --- FP8 scales --------------------------------------------------------------------------------


def test_fp8_weight_without_its_scale(src, tmp_path):
    scale = EXPERT + "_scale_inv"
    rewrite_shard(src, scale, lambda t: t.pop(scale))
    idx = index(src)
    del idx["weight_map"][scale]
    set_index(src, idx)
    assert_clear_error(convert(src, tmp_path / "out"), EXPERT, f"no `{scale}` in the index",
                       "F32[2, 1]", "cannot be dequantized")
    assert_nothing_written(tmp_path / "out")


def test_scale_of_the_wrong_shape(src, tmp_path):
    scale = EXPERT + "_scale_inv"  # [256, 96] in 128x128 blocks -> [2, 1]
    fname = rewrite_shard(src, scale, lambda t: t.update({scale: torch.ones(1, 2)}))
    assert_clear_error(convert(src, tmp_path / "out"), f"{fname} :: {scale}", "F32[1, 2]",
                       "F32/BF16[2, 1] for weight [256, 96]")
    assert_nothing_written(tmp_path / "out")


ATTN = "model.layers.0.self_attn.o_proj.weight"  # block FP8, dequantized to BF16


@pytest.mark.parametrize("case", ["int8_expert", "f16_weight_in_fp8_release", "bf16_weight_with_scale"])
def test_dtype_the_format_does_not_allow(src, tmp_path, case):
    """Raw bytes under an integer dtype, an F16 tensor in an FP8 release, a scale left beside
    a weight that is not FP8: each refused before writing, naming tensor and dtype."""
    if case == "int8_expert":  # the FP8 bytes relabelled as I8
        rewrite_shard(src, EXPERT, lambda t: t.update({EXPERT: t[EXPERT].view(torch.int8)}))
        must = (EXPERT, "I8", "one of F8_E4M3, BF16, F32")
    elif case == "f16_weight_in_fp8_release":
        rewrite_shard(src, NORM, lambda t: t.update({NORM: t[NORM].half()}))
        must = (NORM, "F16", "one of F8_E4M3, BF16, F32")
    else:
        rewrite_shard(src, ATTN, lambda t: t.update({ATTN: t[ATTN].float().bfloat16()}))
        must = (ATTN + "_scale_inv", f"weight {ATTN} is BF16", "scales only beside F8_E4M3")
    for cmd in (["inspect", str(src)], ["plan", str(src)]):
        assert_clear_error(runner.invoke(app, cmd), *must)
    assert_clear_error(convert(src, tmp_path / "out"), *must)
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("case", ["layer_missing", "tensor_missing", "layer_beyond_config"])
def test_layers_that_do_not_match_the_config(src, tmp_path, case):
    """A layer dropped from the checkpoint, one tensor of a layer dropped, or more layers on disk
    than config.json declares: refused before writing (each would load wrong or not at all)."""
    idx = index(src)

    def drop(names: set[str]) -> None:  # from the shards and the index alike
        for fname in sorted({idx["weight_map"][n] for n in names}):
            tensors = load_file(src / fname)
            save_file({k: v for k, v in tensors.items() if k not in names}, src / fname,
                      metadata={"format": "pt"})
        idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if k not in names}
        set_index(src, idx)

    if case == "layer_missing":
        drop({k for k in idx["weight_map"] if k.startswith("model.layers.2.")})
        must = ("no tensors for layer(s) 2", "layers 0..2 (num_hidden_layers 3)")
    elif case == "tensor_missing":
        gone = "model.layers.2.self_attn.o_proj.weight"
        drop({gone, gone + "_scale_inv"})
        must = ("model.layers.2.self_attn.o_proj.weight", "layer 2 lacks 2 tensor(s)")
    else:
        set_config(src, num_hidden_layers=2)
        must = ("layer 3", "layers 0..2 (num_hidden_layers 2 + num_nextn_predict_layers 1)")
    for cmd in (["inspect", str(src)], ["plan", str(src)]):
        assert_clear_error(runner.invoke(app, cmd), *must)
    assert_clear_error(convert(src, tmp_path / "out"), *must)
    assert_nothing_written(tmp_path / "out")


# --- non-finite numbers ------------------------------------------------------------------------


def test_nonfinite_names_exactly_the_tensors_holding_nan_or_inf(src):
    """Checkpoint.nonfinite (the scale check's batched reads: one open per shard, every dtype
    of a shard checked at once) against reading and checking each tensor alone, after NaN and
    Inf were written at random places of scales and BF16 tensors across the shards."""
    import random

    import torch

    ckpt = open_checkpoint(src)
    floats = sorted(n for n, t in ckpt.tensors.items() if t.dtype in ("F32", "BF16") and t.nbytes)
    rng = random.Random(7)
    for name in rng.sample(floats, 9):
        t = ckpt.tensors[name]
        item = 4 if t.dtype == "F32" else 2
        bad = {4: [b"\x00\x00\xc0\x7f", b"\x00\x00\x80\xff"], 2: [b"\xc0\x7f", b"\x80\x7f"]}[item]
        poke(src, name, rng.choice(bad), at=item * rng.randrange(t.nbytes // item))
    ckpt = open_checkpoint(src)
    asked = rng.sample(floats, len(floats))  # any order, a name twice
    asked.append(asked[0])
    want = [n for n in dict.fromkeys(asked) if not torch.isfinite(ckpt.read(n).float()).all()]
    assert len(want) == 9 and len({ckpt.tensors[n].file for n in floats}) > 1
    assert ckpt.nonfinite(asked) == want
    assert ckpt.nonfinite(asked, workers=1) == want
    assert ckpt.nonfinite([n for n in floats if n not in want]) == []


def test_nan_in_a_scale_is_refused_before_writing(src, tmp_path):
    scale = EXPERT + "_scale_inv"
    fname = poke(src, scale, b"\x00\x00\xc0\x7f" + b"\x00\x00\x80\x7f")  # F32 NaN, +Inf
    assert_clear_error(convert(src, tmp_path / "out"), "non-finite FP8 scales", f"{fname} :: {scale}",
                       "1 NaN and 1 Inf value(s), the first at [0, 0]")
    assert_nothing_written(tmp_path / "out")


def test_nan_in_an_fp8_weight_stops_the_run_cleanly(src, tmp_path):
    fname = poke(src, EXPERT, b"\x7f\x7f\xff", at=96 * 5)  # three e4m3 NaNs in row 5
    out = tmp_path / "out"
    text = assert_clear_error(convert(src, out, "--max-shard-size", "200KB"),
                              "non-finite values in the source", f"{fname} :: {EXPERT}",
                              "3 NaN value(s), the first at [5, 0]", "never passed on")
    assert "holds an unfinished conversion" in text and "--overwrite" in text
    assert_unfinished(src, out)


def test_inf_in_a_bf16_tensor(src, tmp_path):
    fname = poke(src, NORM, b"\x80\x7f")  # BF16 +Inf, little-endian
    out = tmp_path / "out"
    assert_clear_error(convert(src, out), f"{fname} :: {NORM}", "1 Inf value(s), the first at [0]")
    assert_unfinished(src, out)


def test_finite_values_whose_sum_overflows_are_no_error(dsa_bf16, tmp_path):
    """A copied BF16 norm holding +3e38 twice: every value is finite, but their float sum is
    Inf, so the cheap finiteness hint (`finite_hint`: the sum) fails and the exact re-check
    must clear it. convert writes the tensor as it is, and the layer loader (verify's layer
    check, the calibration) loads it; a NaN in its place is still refused by the loader."""
    from quantize.calib.decoder import build_skeleton, load_layer
    from quantize.source.weights import finite_hint

    src = Path(shutil.copytree(dsa_bf16, tmp_path / "src"))

    def set_values(value):
        def change(t):
            w = t[NORM].clone()
            w[0] = w[1] = value
            t[NORM] = w
        rewrite_shard(src, NORM, change)
        return open_checkpoint(src)

    ck = set_values(3e38)
    norm = ck.read(NORM)
    assert not bool(finite_hint(norm)) and bool(torch.isfinite(norm).all())  # the case at hand
    out = tmp_path / "out"
    r = convert(src, out)
    assert r.exit_code == 0, r.output
    assert torch.equal(load_file(out / index(out)["weight_map"][NORM])[NORM], norm)
    units = {u.source: u for u in make_plan(ck, ConvertOptions()).units}
    layer = load_layer(build_skeleton(ck.config), ck, units, 0, torch.device("cpu"), torch.float32)
    assert torch.equal(layer.input_layernorm.weight.detach(), norm.float())
    ck = set_values(float("nan"))
    with pytest.raises(QuantizeError, match="non-finite values in the source"):
        load_layer(build_skeleton(ck.config), ck, units, 0, torch.device("cpu"), torch.float32)


def test_finite_weights_whose_group_range_overflows(dsa_bf16, tmp_path):
    """BF16 +-3e38 in one group: finite, but max - min overflows float32, so an asymmetric
    scale would be Inf; refused naming the tensor (before: an Inf scale was written)."""
    src = Path(shutil.copytree(dsa_bf16, tmp_path / "src"))

    def huge(t):
        w = t[EXPERT].clone()
        w[0, 0], w[0, 1] = 3e38, -3e38
        t[EXPERT] = w
    fname = rewrite_shard(src, EXPERT, huge)
    out = tmp_path / "out"
    assert_clear_error(convert(src, out, "--asymmetric"), f"{fname} :: {EXPERT}",
                       "weights too large for INT4 group scales", "|w| up to 3e+38")
    assert_unfinished(src, out)


# --- shapes and layouts ------------------------------------------------------------------------


def test_expert_shapes_that_differ_from_the_config(src, tmp_path):
    set_config(src, moe_intermediate_size=128)  # the tensors are 96 wide
    text = assert_clear_error(convert(src, tmp_path / "out"),
                              "the routed experts do not match config.json",
                              "model.layers.1.mlp.experts.0.gate_proj.weight: shape [96, 256]",
                              "[128, 256] from config.json (moe_intermediate_size 128, hidden_size 256)")
    assert "down_proj.weight: shape [256, 96]" in text
    assert_nothing_written(tmp_path / "out")


def test_expert_count_that_differs_from_the_config(src, tmp_path):
    set_config(src, n_routed_experts=9)  # the checkpoint has 8 per layer
    assert_clear_error(convert(src, tmp_path / "out"), INDEX_NAME,
                       "3 expert weight(s) missing (first: 8.gate_proj)", "re-download")
    set_config(src, n_routed_experts=7)
    assert_clear_error(convert(src, tmp_path / "out"), "model.layers.1.mlp.experts.7.",
                       "experts 0..6 (n_routed_experts 7)")
    assert_nothing_written(tmp_path / "out")


def test_in_dimension_the_group_size_cannot_tile(src, tmp_path):
    """down_proj has K = moe_intermediate_size = 96: 96 % 64 != 0. Refused, not padded: the
    engines size `weight_scale` from K // group_size, so a padded tensor would not load."""
    text = assert_clear_error(convert(src, tmp_path / "out", "--group-size", "64"),
                              "the group size does not tile these weights", "in_features 96",
                              "a multiple of --group-size 64", "pick a --group-size that divides it")
    assert "model.layers.1.mlp.experts.0.down_proj.weight" in text
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes"])
def test_unknown_quant_method(src, tmp_path, method):
    set_config(src, quantization_config={"quant_method": method, "bits": 4})
    assert_clear_error(convert(src, tmp_path / "out"), "config.json", "unknown quantization method",
                       f"quant_method={method!r}", "cannot be re-quantized")
    assert_nothing_written(tmp_path / "out")


def test_unknown_model_type_without_routed_experts(tmp_path):
    """'Unknown model type' means: no tensor has a role we were asked to quantize. The tool
    reads roles from tensor names, not `model_type`, so a dense Llama is refused unless
    `--targets dense` asks for its MLPs, and then converted."""
    src = tmp_path / "llama"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    w = {"model.embed_tokens.weight": (128, 64), "model.norm.weight": (64,),
         "lm_head.weight": (128, 64), "model.layers.0.input_layernorm.weight": (64,),
         "model.layers.0.self_attn.q_proj.weight": (64, 64),
         "model.layers.0.mlp.gate_proj.weight": (96, 64),
         "model.layers.0.mlp.up_proj.weight": (96, 64),
         "model.layers.0.mlp.down_proj.weight": (64, 96)}
    save_file({n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in w.items()},
              src / "model.safetensors", metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    assert_clear_error(convert(src, tmp_path / "out"), "nothing to quantize",
                       "no Linear of role routed", "dense models need --targets dense")
    assert_nothing_written(tmp_path / "out")
    r = convert(src, tmp_path / "out", "--targets", "dense")
    assert r.exit_code == 0, r.output


# --- remote code -------------------------------------------------------------------------------


def test_trust_remote_code_is_copied_never_executed(src, tmp_path):
    """Remote code of the model and of the tokenizer: copied, never imported, even where
    transformers would ask "run the custom code? [y/N]" on stdin (stdin answers y here)."""
    marker = tmp_path / "EXECUTED"
    code = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('pwned')\n"
    evil = ("modeling_evil.py", "configuration_evil.py", "tokenization_evil.py", "__init__.py")
    for f in evil:
        (src / f).write_text(code)
    set_config(src, auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                              "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    write_tokenizer(src, json.loads((src / "config.json").read_text())["vocab_size"])
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    tok_cfg["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer",
                                             "tokenization_evil.EvilTokenizerFast"]}
    (src / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    calib = tmp_path / "calib.txt"
    calib.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    yes = "y\n" * 4
    out = tmp_path / "out"

    def gptq(dst: Path):
        return convert(src, dst, "--method", "gptq", "--calib", str(calib), "--num-samples", "2",
                       "--seq-len", "32", input=yes)

    def evaluate():
        return runner.invoke(app, ["eval", str(src), str(out), "--num-samples", "1", "--seq-len",
                                   "32", "--device", "cpu"], input=yes)

    for cmd in (["inspect", str(src)], ["plan", str(src), "--tp", "1"]):
        assert runner.invoke(app, cmd, input=yes).exit_code == 0
    r = convert(src, out, input=yes)
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["verify", str(src), str(out)], input=yes)
    assert r.exit_code == 0, r.output
    # tokenizer_config.json names a transformers class too: that one is used, with no question
    r = evaluate()
    assert r.exit_code == 0, r.output
    r = gptq(tmp_path / "gptq")
    assert r.exit_code == 0, r.output
    assert not marker.exists(), "remote code was executed"
    for f in evil:
        assert (out / f).read_bytes() == (src / f).read_bytes()
    assert json.loads((out / "config.json").read_text())["auto_map"]["AutoConfig"] == \
        "configuration_evil.EvilConfig"
    assert json.loads((tmp_path / "gptq" / "tokenizer_config.json").read_text()) == tok_cfg

    # only its own code: transformers would ask on stdin (and run it on y); refused instead
    del tok_cfg["tokenizer_class"]
    for d in (src, out):
        (d / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    assert_clear_error(evaluate(), "eval needs the checkpoint's tokenizer",
                       "a tokenizer's own code is never run")
    assert not marker.exists(), "remote code was executed by eval"
    assert_clear_error(gptq(tmp_path / "gptq2"), "calibration needs the checkpoint's tokenizer",
                       "a tokenizer's own code is never run")
    assert not marker.exists(), "remote code was executed by a calibrated convert"
    assert_nothing_written(tmp_path / "gptq2")


# --- the disk fills up -------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (the output is ~3.7 MiB); skipped where mounting is not allowed."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_disk_full_stops_cleanly_and_resumes(dsa_fp8, small_disk, tmp_path):
    out = small_disk / "out"
    args = ["--max-shard-size", "200KB"]
    # too small from the start: refused up front (the plan knows the bytes), nothing written
    assert_clear_error(convert(dsa_fp8, out, *args), "not enough free disk space",
                       "2.00 MiB free", "MiB of shards", "a larger disk")
    assert not out.exists() or not any(out.iterdir())

    # room at the start, then another program fills the disk during the run
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)
    filler = small_disk / "filler"

    def fill(unit) -> None:  # once some shards are recorded
        if filler.exists() or not unit.source.startswith("model.layers.2."):
            return
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 2**16)
                    f.flush()
            except OSError:
                pass

    from quantize.pipeline import convert as run_convert
    from quantize.write.manifest import output_state

    with pytest.raises(QuantizeError) as e:
        run_convert(dsa_fp8, out, ConvertOptions(max_shard_size=200_000), device="cpu", on_unit=fill,
                    tp=1)
    text = f"{e.value}\n{output_state(out)}"
    for m in ("the disk filled up while writing", "No space left on device (errno 28)",
              "then rerun the same command", "holds an unfinished conversion"):
        assert m in text, f"{m!r} not in:\n{text}"
    filler.unlink()
    manifest = json.loads((out / MANIFEST).read_text())  # still valid JSON, still in-progress
    assert manifest["status"] == "in-progress" and manifest["files"]
    for name, rec in manifest["files"].items():  # what it vouches for is intact
        assert sha256_file(out / name) == rec["sha256"]
    assert_unfinished(dsa_fp8, out)

    r = convert(dsa_fp8, out, *args)
    assert r.exit_code == 0, r.output
    assert f"{len(manifest['files'])} kept from an earlier run" in r.output
    ref = tmp_path / "ref"
    assert convert(dsa_fp8, ref, *args).exit_code == 0
    for p in sorted(ref.iterdir()):
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ref.iterdir())


def test_read_only_output_is_a_clear_error(dsa_fp8, small_disk):
    out = small_disk / "out"
    out.mkdir()  # room enough (the up-front disk check passes), but read-only
    subprocess.run(["mount", "-o", "remount,size=16m,ro", str(small_disk)], check=True)
    assert_clear_error(convert(dsa_fp8, out), "could not write the output", "Read-only file system",
                       "a writable output folder")
    assert not any(out.iterdir())
    r = convert(dsa_fp8, small_disk / "new")
    assert_clear_error(r, "could not write the output", f"{small_disk / 'new'}: Read-only file system")


def test_awq_scales_on_a_full_disk_are_a_clean_error(small_disk, tmp_path):
    """The AWQ scales (calibration/awq-scales.safetensors, written after the report) filling
    the disk: the same clean error as a shard, no half-written file left behind."""
    cfg = tiny_config("glm4_moe", num_hidden_layers=2)
    src = write_checkpoint(tmp_path / "src", cfg, "fp8-channel", seed=4)
    write_tokenizer(src, cfg["vocab_size"])
    ckpt = open_checkpoint(src)
    opts = ConvertOptions(method="awq", num_samples=2, seq_len=32)
    calib = Calibrator(ckpt, make_plan(ckpt, opts), opts, torch.device("cpu"))
    roomy = tmp_path / "roomy"
    roomy.mkdir()
    assert calib.write_outputs(roomy) == [CALIB_REPORT, AWQ_SCALES]  # runs the layers
    st = os.statvfs(small_disk)
    page = st.f_frsize
    report_pages = -(-(roomy / CALIB_REPORT).stat().st_size // page)
    assert (roomy / AWQ_SCALES).stat().st_size > 0
    # fill the disk to the page: room for the report, none for the scales
    (small_disk / "filler").write_bytes(bytes(st.f_bavail * page - report_pages * page))
    assert os.statvfs(small_disk).f_bavail == report_pages
    with pytest.raises(QuantizeError, match="the disk filled up while writing") as e:
        calib.write_outputs(small_disk)
    assert f"{small_disk / AWQ_SCALES}: No space left on device (errno 28)" in str(e.value)
    assert (small_disk / CALIB_REPORT).read_bytes() == (roomy / CALIB_REPORT).read_bytes()
    assert not (small_disk / AWQ_SCALES).exists() and not list(small_disk.rglob("*.partial"))


def test_a_failed_folder_sync_is_a_clean_write_error(tmp_path):
    """After the rename, the folder is opened and fsynced (the new name is durable only then);
    that failing is a write error like any other, not a traceback. A folder that can be written
    but not read (mode 0300) makes the open fail for real, in a process without root's
    permission override (setpriv drops it)."""
    d = tmp_path / "out"
    d.mkdir()
    (tmp_path / "tokenizer.json").write_text("{}")
    d.chmod(0o300)
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "import torch\n"
        "from quantize.errors import QuantizeError\n"
        "from quantize.plan import OutTensor\n"
        "from quantize.write.shards import ShardWriter, copy_file_atomic, write_json_atomic\n"
        "d = Path(sys.argv[1])\n"
        "def shard():\n"
        "    with ShardWriter(d / 'model-00001-of-00001.safetensors', [OutTensor('t', 'F32', (2,))]) as w:\n"
        "        w.write(torch.ones(2))\n"
        "for write in (lambda: write_json_atomic(d / 'config.json', {}), shard,\n"
        "              lambda: copy_file_atomic(d.parent / 'tokenizer.json', d / 'tokenizer.json')):\n"
        "    try:\n"
        "        write()\n"
        "    except QuantizeError as e:\n"
        "        print(e)\n")
    drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
    if drop and subprocess.run([*drop, "true"], capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot drop root's permission override here (setpriv)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([*drop, sys.executable, "-c", code, str(d)], env=env, capture_output=True,
                       text=True, check=False, timeout=120)
    d.chmod(0o700)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("could not write the output") == 3, r.stdout
    for name in ("config.json", "model-00001-of-00001.safetensors", "tokenizer.json"):
        assert f"{d / name}: Permission denied (errno 13)" in r.stdout, r.stdout
    assert not list(d.glob("*.partial"))


@pytest.mark.parametrize("text", ["{not json", "[]", '{"status": "complete"}'])
def test_damaged_output_manifest(dsa_fp8, tmp_path, text):
    out = tmp_path / "out"
    out.mkdir()
    (out / MANIFEST).write_text(text)
    assert_clear_error(convert(dsa_fp8, out), f"{out / MANIFEST}", "the output's manifest is unreadable",
                       "pass --overwrite")
    r = runner.invoke(app, ["verify", str(dsa_fp8), str(out)])
    assert r.exit_code == 2 and "the output's manifest is unreadable" in r.output
    r = convert(dsa_fp8, out, "--overwrite")
    assert r.exit_code == 0, r.output


def header_of(path: Path) -> tuple[dict, bytes]:
    """A shard's header and its data section."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def write_shard(path: Path, header: dict | str, body: bytes) -> None:
    """A shard of `header` (or that JSON text, as is) and the data section `body`."""
    text = (header if isinstance(header, str) else json.dumps(header, separators=(",", ":"))).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + body)


@pytest.mark.parametrize("case", ["overlap", "gap", "trailing", "duplicate"])
def test_shard_data_that_overlaps_or_leaves_holes(src, tmp_path, case):
    """Two entries sharing bytes, a hole between them, bytes after the last one, or one name
    twice: the safetensors library refuses such a file, and so does the reader."""
    fname = index(src)["weight_map"][EXPERT]
    p = src / fname
    header, body = header_of(p)
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    a = names[0]
    if case == "overlap":  # b's entry points at a's bytes (a same-shape pair)
        same = [k for k in names
                if (header[k]["shape"], header[k]["dtype"]) == (header[a]["shape"], header[a]["dtype"])]
        a, b = same[0], same[1]
        header[b]["data_offsets"] = list(header[a]["data_offsets"])
        says = "overlap"
    elif case == "gap":  # 64 unused bytes before the last tensor
        last = names[-1]
        begin = header[last]["data_offsets"][0]
        body = body[:begin] + b"\0" * 64 + body[begin:]
        header[last]["data_offsets"] = [o + 64 for o in header[last]["data_offsets"]]
        says = "64 bytes no tensor uses"
    elif case == "trailing":
        body += b"\0" * 16
        says = "16 bytes after the last tensor"
    else:  # the same name twice: one more entry in the JSON text, pointing at a's bytes
        text = json.dumps(header, separators=(",", ":"))
        header = text[:-1] + "," + json.dumps({a: header[a]}, separators=(",", ":"))[1:-1] + "}"
        says = f"names {a} twice"
    write_shard(p, header, body)
    assert_clear_error(convert(src, tmp_path / "out"), fname, says, "re-download this shard")
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("case", ["unlisted", "two_shards"])
def test_index_and_shard_headers_must_agree(src, tmp_path, case):
    """A tensor a shard holds but the index does not list would be dropped from the output;
    a tensor two shards hold would be taken from one of them silently. Both are refused."""
    idx = index(src)
    if case == "unlisted":
        fname = idx["weight_map"].pop(NORM)
        set_index(src, idx)
        says = [f"{fname} :: {NORM}", "in this shard but not in the index"]
    else:
        other = next(f for f in sorted(set(idx["weight_map"].values())) if f != idx["weight_map"][NORM])
        norm = load_file(src / idx["weight_map"][NORM])[NORM]
        tensors = load_file(src / other)
        tensors[NORM] = norm.clone()
        save_file(tensors, src / other, metadata={"format": "pt"})
        says = [f"{other} :: {NORM}", f"also in {idx['weight_map'][NORM]}"]
    assert_clear_error(convert(src, tmp_path / "out"), "the index and the shard headers disagree",
                       *says)
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("field,value", [
    ("num_nextn_predict_layers", "x"), ("num_hidden_layers", 10**10), ("num_hidden_layers", 0),
    ("n_routed_experts", None), ("hidden_size", 6144.0), ("weight_block_size", [0, 0]),
    ("weight_block_size", ["a", "b"]), ("num_experts_per_tok", True)])
def test_config_values_that_cannot_be_used(src, tmp_path, field, value):
    """A string, 0, a float, a bool or 10**10 where an integer belongs (or a block size of 0):
    exit 2 naming config.json, the field, the value and what was expected, before anything is
    read or allocated (inspect included), never a traceback."""
    if field == "weight_block_size":
        cfg = json.loads((src / "config.json").read_text())
        cfg["quantization_config"]["weight_block_size"] = value
        (src / "config.json").write_text(json.dumps(cfg))
        shown = "quantization_config.weight_block_size"
    else:
        set_config(src, **{field: value})
        shown = field
    if value is None:  # null where the weights hold routed experts (issue 25: it was accepted)
        for cmd in (["inspect", str(src)], ["plan", str(src)]):
            assert_clear_error(runner.invoke(app, cmd), "the routed experts do not match config.json",
                               f"config.json :: {shown}", f"{field} = null")
        assert_clear_error(convert(src, tmp_path / "out"), f"{field} = null")
        assert_nothing_written(tmp_path / "out")
        return
    for cmd in (["inspect", str(src)], ["plan", str(src)]):
        assert_clear_error(runner.invoke(app, cmd), "config.json has values the tool cannot use",
                           f"config.json :: {shown}", json.dumps(value), "an integer" if
                           field != "weight_block_size" else "two positive integers")
    assert_clear_error(convert(src, tmp_path / "out"), "config.json has values the tool cannot use")
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("block", [[129, 129], [96, 128], [256, 256]])
def test_block_size_other_than_the_scales_imply_is_refused(src, tmp_path, block):
    """weight_block_size must be the block the scales were made with: [129, 129] fits every
    scale shape of this model (ceil(n / 129) == ceil(n / 128) here) but is no power of two and
    would move 2.5 % of the weights to another block's scale; [96, 128] and [256, 256] give
    other scale shapes. Refused by plan and convert, naming the field and the implied block."""
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = block
    (src / "config.json").write_text(json.dumps(cfg))
    for r in (runner.invoke(app, ["plan", str(src)]), convert(src, tmp_path / "out")):
        assert_clear_error(r, "config.json :: quantization_config.weight_block_size",
                           f"weight_block_size = {block}", "the block the scales' shapes imply",
                           "weight_block_size [128, 128]")
    assert_nothing_written(tmp_path / "out")
    cfg["quantization_config"]["weight_block_size"] = [128, 128]  # the release's: accepted
    (src / "config.json").write_text(json.dumps(cfg))
    assert runner.invoke(app, ["plan", str(src), "--tp", "1"]).exit_code == 0


# --- push: only this conversion's own files (issue 25, defects 1 and 9) --------------------------


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    """A converted, verified and evaluated tiny output (verify.json, eval.json, their pictures)."""
    from quantize.check.evaluate import EvalOptions, evaluate
    from quantize.check.verify import verify
    from quantize.pipeline import convert as run_convert

    d = tmp_path_factory.mktemp("pushable")
    cfg = tiny_config("glm4_moe", num_hidden_layers=2)
    src = write_checkpoint(d / "src", cfg, "fp8-channel")
    write_tokenizer(src, cfg["vocab_size"])
    out = d / "out"
    run_convert(src, out, ConvertOptions(), device="cpu", tp=1)
    assert verify(src, out, device="cpu").ok
    evaluate(src, out, EvalOptions(num_samples=1, seq_len=32, ood="none"), device="cpu")
    return out


def _pushable_copy(verified: Path, tmp_path: Path) -> Path:
    dst = Path(shutil.copytree(verified, tmp_path / "out"))
    for p in sorted(verified.rglob("*")):  # mtimes kept in order: verify.json after the manifest
        shutil.copystat(p, dst / p.relative_to(verified))
    return dst


def dry_push(dst: Path):
    return runner.invoke(app, ["push", str(dst), "org/GLM-tiny-INT4", "--dry-run"])


def test_push_refuses_a_picture_linked_outside_the_folder(verified, tmp_path):
    """A picture push adds beside the manifest's files, linked to a file elsewhere on the
    machine: refused by name (it was listed, and uploaded, with the outside file's bytes)."""
    from quantize.names import PICTURES

    dst = _pushable_copy(verified, tmp_path)
    assert dry_push(dst).exit_code == 0
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"not for the Hub " * 100)
    for pic in PICTURES:
        if (dst / pic).is_file():
            (dst / pic).unlink()
            (dst / pic).symlink_to(secret)
            break
    else:
        pytest.skip("no picture drawn (matplotlib not installed)")
    r = dry_push(dst)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert pic in r.output and "a link to" in r.output and "secret.txt" not in r.stdout.split("error")[0]
    assert str(len(secret.read_bytes())) not in r.stdout


def test_push_refuses_a_weight_file_replaced_by_a_link(verified, tmp_path):
    """A manifest file replaced by a link to an identical copy elsewhere: refused by name."""
    dst = _pushable_copy(verified, tmp_path)
    shard = next(p for p in sorted(dst.glob("*.safetensors")))
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(outside)
    r = dry_push(dst)
    assert r.exit_code == 2 and shard.name in r.output and "a link to" in r.output, r.output


def test_push_refuses_pictures_and_reports_not_of_this_conversion(verified, tmp_path):
    """A picture whose bytes no report of this conversion names, and an eval.json written for
    another manifest: refused by name, with the command that writes them again."""
    from quantize.names import EVAL_JSON, PICTURES

    dst = _pushable_copy(verified, tmp_path)
    pics = [p for p in PICTURES if (dst / p).is_file()]
    if not pics:
        pytest.skip("no picture drawn (matplotlib not installed)")
    (dst / pics[0]).write_bytes((dst / pics[0]).read_bytes() + b"\0")
    r = dry_push(dst)
    assert r.exit_code == 2 and pics[0] in r.output and "no report of this conversion" in r.output

    dst = _pushable_copy(verified, tmp_path / "2")
    ev = json.loads((dst / EVAL_JSON).read_text())
    ev["manifest_sha256"] = "0" * 64
    (dst / EVAL_JSON).write_text(json.dumps(ev))
    r = dry_push(dst)
    assert r.exit_code == 2 and "eval.json" in r.output and "quantize eval" in r.output, r.output


@pytest.mark.parametrize("text", ["[1, 2, 3]", "{not json", ""])
def test_push_on_a_malformed_verify_json(verified, tmp_path, text):
    """verify.json that is a JSON list, not JSON, or empty: exit 2 naming verify.json and the
    fix (it raised AttributeError, or 'Expecting value' naming no file)."""
    dst = _pushable_copy(verified, tmp_path)
    (dst / "verify.json").write_text(text)
    r = dry_push(dst)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "verify.json" in r.output and "quantize verify" in r.output, r.output


def test_push_refuses_a_nan_sqnr_floor(verified, tmp_path):
    """A verify.json whose SQNR floor is NaN does not pass the floor check (NaN < 12 is False)."""
    dst = _pushable_copy(verified, tmp_path)
    rep = json.loads((dst / "verify.json").read_text())
    rep["min_sqnr_db_threshold"] = float("nan")
    (dst / "verify.json").write_text(json.dumps(rep))
    r = dry_push(dst)
    assert r.exit_code == 2 and "SQNR floor" in r.output, r.output


# --- run files and calibration records (issue 25, defects 4 and 6; /dev/zero) --------------------


@pytest.mark.parametrize("text,must", [
    ("convert = 5\n", "expected a [convert] table"),
    ("[convert]\ntargets = [1, 2]\n", "targets = [1, 2] is a list"),
    ("[convert]\ngroup_size = \"64\"\n", "group_size = '64' is a string; expected an integer"),
    ("[convert]\nkeep_fp8 = 1\n", "keep_fp8 = 1 is an integer; expected true or false"),
    ("[convert]\nnum_samples = true\n", "num_samples = True is true or false; expected an integer"),
    ("[convert]\ngroup-size = 64\ngroup_size = 128\n", "group_size is given twice"),
])
def test_run_file_values_of_the_wrong_type(dsa_fp8, tmp_path, text, must):
    """A --config file's key of the wrong type, or given twice in two spellings: exit 2 naming
    the key, the type found and the type expected (they raised AttributeError / TypeError, or
    silently took the last)."""
    cfg = tmp_path / "run.toml"
    cfg.write_text(text)
    r = runner.invoke(app, ["convert", "--config", str(cfg), str(dsa_fp8), str(tmp_path / "o")],
                      env={"COLUMNS": "300"})
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert must in " ".join(r.output.split()), r.output
    assert not (tmp_path / "o").exists()


def test_a_run_record_whose_src_is_not_a_string(dsa_fp8, tmp_path):
    """`--from` a folder whose run record says `src = 5`: exit 2 naming src and the types."""
    old = tmp_path / "old"
    old.mkdir()
    (old / "quantize-run.toml").write_text("[convert]\nsrc = 5\n")
    r = runner.invoke(app, ["convert", "--from", str(old), str(tmp_path / "new")],
                      env={"COLUMNS": "300"})
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "src = 5 is an integer; expected a string" in " ".join(r.output.split()), r.output


@pytest.mark.parametrize("flag", ["--config", "--calib"])
def test_a_device_as_run_file_or_calibration_text(dsa_fp8, tmp_path, flag):
    """/dev/zero as --config or --calib: refused at once as not a regular file (it was read
    without end, or until memory ran out)."""
    r = runner.invoke(app, ["convert", str(dsa_fp8), str(tmp_path / "o"), "--method", "gptq",
                            "--device", "cpu", "--tp", "1", "--seq-len", "32", "--num-samples",
                            "2", flag, "/dev/zero"],
                      env={"COLUMNS": "300"})
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "not a regular file" in " ".join(r.output.split()), r.output


@pytest.mark.parametrize("messages,must", [
    ([1, 2, 3], "message 0 of `messages`"),
    ([{"role": "user"}], "message 0 of `messages`"),
    ([{"role": "user", "content": "hi"}, "bye"], "message 1 of `messages`"),
])
def test_chat_records_whose_messages_are_not_messages(dsa_fp8, tmp_path, messages, must):
    """A chat record whose messages are not {role, content} objects: refused by file and line
    (it ended in AttributeError or TypeError)."""
    src = Path(shutil.copytree(dsa_fp8, tmp_path / "src"))
    write_tokenizer(src, tiny_config("glm_moe_dsa")["vocab_size"])
    calib = tmp_path / "chat.jsonl"
    calib.write_text(json.dumps({"text": "plain words " * 20}) + "\n"
                     + json.dumps({"messages": messages}) + "\n")
    r = convert(src, tmp_path / "o", "--method", "gptq", "--num-samples", "2", "--seq-len", "32",
                "--calib", str(calib))
    assert_clear_error(r, f"{calib}:2", must)


def test_a_chat_template_that_raises(dsa_fp8, tmp_path):
    """The checkpoint's chat template raising on a record: one line naming the tokenizer's
    files, not the template engine's traceback."""
    src = Path(shutil.copytree(dsa_fp8, tmp_path / "src"))
    write_tokenizer(src, tiny_config("glm_moe_dsa")["vocab_size"])
    tc = json.loads((src / "tokenizer_config.json").read_text())
    tc["chat_template"] = "{{ raise_exception('roles must alternate') }}"
    (src / "tokenizer_config.json").write_text(json.dumps(tc))
    calib = tmp_path / "chat.jsonl"
    calib.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    r = convert(src, tmp_path / "o", "--method", "gptq", "--num-samples", "2", "--seq-len", "32",
                "--calib", str(calib))
    assert_clear_error(r, "tokenizer_config.json", "roles must alternate")


def test_verify_of_a_group_scale_with_its_sign_flipped(tmp_path):
    """One group's scale negated in the output (manifest re-signed): verify names the tensor
    on a `fail:` line and exits 1, and the card it refreshes says the error is not finite (the
    card's formatting raised TypeError on verify.json's null: exit 1 with a traceback)."""
    import hashlib

    from quantize.pipeline import convert as run_convert

    src = write_checkpoint(tmp_path / "src", tiny_config("glm4_moe", num_hidden_layers=2), "fp8-channel")
    out = tmp_path / "out"
    run_convert(src, out, ConvertOptions(), device="cpu", tp=1)
    shard = min(out.glob("*.safetensors"))
    t = load_file(shard)
    name = next(k for k in sorted(t) if k.endswith("weight_scale") and ".experts." in k)
    t[name][0, 0] = -t[name][0, 0]
    save_file(t, shard, metadata={"format": "pt"})
    m = json.loads((out / MANIFEST).read_text())
    m["files"][shard.name] = {"bytes": shard.stat().st_size,
                              "sha256": hashlib.sha256(shard.read_bytes()).hexdigest()}
    (out / MANIFEST).write_text(json.dumps(m))
    r = runner.invoke(app, ["verify", str(src), str(out), "--device", "cpu", "--no-layer-check"],
                      env={"COLUMNS": "300"})
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output
    tensor = name.removesuffix("_scale")
    assert f"fail: {tensor}: non-finite or non-positive scale" in r.output, r.output
    card = (out / "README.md").read_text()
    assert "**FAIL**" in card and "| max relative error | not finite |" in card


def test_an_output_name_that_is_not_utf8(dsa_fp8, tmp_path):
    """DST with a byte that is not UTF-8 in its name: refused before any work (it converted
    every shard, then failed writing the card with a raw codec message, left README.md.tmp and
    claimed an earlier, complete conversion that never existed)."""
    out = tmp_path / os.fsdecode(b"GLM-INT4-\xff")
    r = convert(dsa_fp8, out)
    assert_clear_error(r, "not UTF-8")
    assert not out.exists()
    assert "earlier, complete conversion" not in r.output


def test_verify_misses_no_file_convert_copied_and_names_the_users(dsa_fp8, tmp_path):
    """tokenizer_config.json removed from the output together with its manifest entry: verify
    fails, naming it (it passed); a file of the user's in the folder is said as a note (it was
    accepted without a word), and does not fail verify."""
    from quantize.pipeline import convert as run_convert

    src = Path(shutil.copytree(dsa_fp8, tmp_path / "src"))
    write_tokenizer(src, tiny_config("glm_moe_dsa")["vocab_size"])
    out = tmp_path / "out"
    run_convert(src, out, ConvertOptions(), device="cpu", tp=1)
    (out / "notes.txt").write_text("my notes\n")
    r = runner.invoke(app, ["verify", str(src), str(out), "--device", "cpu", "--no-layer-check"],
                      env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    assert "note: notes.txt: in the folder, not part of the conversion" in r.output
    (out / "tokenizer_config.json").unlink()
    m = json.loads((out / MANIFEST).read_text())
    del m["files"]["tokenizer_config.json"]
    (out / MANIFEST).write_text(json.dumps(m))
    r = runner.invoke(app, ["verify", str(src), str(out), "--device", "cpu", "--no-layer-check"],
                      env={"COLUMNS": "300"})
    assert r.exit_code == 1, r.output
    assert "tokenizer_config.json: in the source, missing from the output" in r.output


# --- the command line itself (issue 25, defects 2 and 5; --json errors) ---------------------------


def test_recorded_command_keeps_every_flag_with_its_value(tmp_path):
    """The command the manifest and the card publish is one a reader can paste: each flag
    keeps its value (issue 25, defect 2: `--group-size 64` was recorded as `'' 64`), and local
    paths become names."""
    from pathlib import Path

    from quantize.cli.run_record import public_command

    src, dst = tmp_path / "models" / "GLM-tiny-FP8", tmp_path / "out" / "GLM-tiny-INT4"
    src.mkdir(parents=True)
    calib = tmp_path / "my-calib.jsonl"
    calib.write_text("{}\n")
    args = ["convert", str(src), str(dst), "--group-size", "64", "--max-shard-size", "2MB", "-g",
            "32", "--calib", str(calib), f"--calib={calib}", "--asymmetric", "--percdamp", "-0.5"]
    got = public_command(args, str(src), Path(dst), "zai-org/GLM-4.6-FP8")
    assert got == ("quantize convert zai-org/GLM-4.6-FP8 GLM-tiny-INT4 --group-size 64 "
                   "--max-shard-size 2MB -g 32 --calib my-calib.jsonl --calib=my-calib.jsonl "
                   "--asymmetric --percdamp -0.5")


@pytest.mark.parametrize("flag,value", [
    ("--max-gpu-memory", "inf"), ("--max-gpu-memory", "1e400"), ("--max-gpu-memory", "nan"),
    ("--max-gpu-memory", "-5"), ("--max-gpu-memory", "0"), ("--checkpoint-interval", "nan"),
    ("--checkpoint-interval", "-1")])
def test_numeric_options_out_of_range_name_the_option(dsa_fp8, tmp_path, flag, value):
    """Each of convert's numbers is checked where the options are built: one line naming the
    option and exit 2, before anything is written (issue 25, defect 5). (Both are calibration
    options: with rtn they are refused as such, test_cli.)"""
    out = tmp_path / "o"
    r = runner.invoke(app, ["convert", str(dsa_fp8), str(out), "--device", "cpu", "--tp", "1",
                            "--method", "gptq", flag, value])
    assert r.exit_code == 2, r.output
    assert f"error: {flag} " in r.output and "Traceback" not in r.output, r.output
    assert not out.exists() or not any(out.iterdir())


def test_json_errors_are_a_json_object_on_stdout(tmp_path):
    """With --json an error is also a JSON object on stdout (schema_version, error, problems),
    besides the line on stderr: a script reading stdout sees why (issue 25)."""
    missing = tmp_path / "nowhere"
    for cmd in (["inspect", str(missing), "--json"], ["plan", str(missing), "--json"],
                ["verify", str(missing), str(tmp_path / "o"), "--json"]):
        r = runner.invoke(app, cmd)
        assert r.exit_code == 2, r.output
        d = json.loads(r.stdout)
        assert d["schema_version"] >= 1 and d["error"], d
        assert isinstance(d["problems"], list)
        assert "error:" in r.stderr


def test_a_hand_edited_eval_json_with_nan_in_the_card(verified, tmp_path):
    """eval.json whose figures are NaN (hand-edited): the card says 'not a number' for each
    (it printed 'nan')."""
    from quantize.publish.readme import card_text

    dst = _pushable_copy(verified, tmp_path)
    ev = json.loads((dst / "eval.json").read_text())
    ev["summary"].update(ppl_ratio=float("nan"), kl_mean=float("nan"), top1_agreement=float("nan"))
    (dst / "eval.json").write_text(json.dumps(ev))
    card = card_text(dst)
    rows = [line for line in card.splitlines() if line.startswith(("| perplexity ratio",
                                                                    "| mean KL", "| same top-1"))]
    assert len(rows) == 3 and all("not a number" in r and "nan" not in r for r in rows), rows


def test_a_failure_after_the_manifest_completes_claims_no_earlier_conversion(dsa_fp8, tmp_path,
                                                                             monkeypatch):
    """A step after the last shard fails (here the card: a disk error while writing it): the
    hint says this run's conversion is complete and a step after it failed, not that the folder
    'still holds the earlier, complete conversion' (there was none; issue 25, defect 7); a run
    over a folder that was complete before keeps that sentence, one with --overwrite not."""
    import quantize.publish.readme

    def broken(*a, **k):
        raise QuantizeError("cannot write README.md", [])

    out = tmp_path / "o"
    monkeypatch.setattr(quantize.publish.readme, "write_readme", broken)
    r = convert(dsa_fp8, out)
    assert r.exit_code == 2, r.output
    assert "this run's complete conversion" in r.output and "earlier" not in r.output, r.output
    monkeypatch.undo()
    assert convert(dsa_fp8, out).exit_code == 0  # the card written: a complete folder
    monkeypatch.setattr(quantize.publish.readme, "write_readme", broken)
    r = convert(dsa_fp8, out)  # the same command again: the folder was complete before it
    assert r.exit_code == 2 and "still holds the earlier, complete conversion" in r.output, r.output
    r = convert(dsa_fp8, out, "--overwrite")  # nothing of before is kept
    assert r.exit_code == 2 and "this run's complete conversion" in r.output, r.output


def test_source_files_named_like_our_outputs_are_not_copied(tmp_path):
    """A source folder holding files named as our tools' outputs (verify.json, eval.json,
    quantize-run.toml, the pictures, a file `calibration` where a calibrated run puts its
    folder): none is copied, the calibrated conversion finishes, verifies, and push accepts
    the folder (on 1d01519: a KeyError traceback, an output failing its own verify, a folder
    push never accepted, a calibrated run failing after every shard)."""
    from quantize.check.verify import verify
    from quantize.pipeline import convert
    from quantize.publish.push import prepare_push

    cfg = tiny_config("glm4_moe")
    src = write_checkpoint(tmp_path / "src", cfg, "fp8-channel")
    write_tokenizer(src, cfg["vocab_size"])
    foreign = {"verify.json": '{"summary": {}}', "eval.json": '{"summary": {"verdict": "pass"}}',
               "quantize-run.toml": 'src = "elsewhere"\n', "verify-sqnr.png": "not a picture",
               "eval-layers.png": "not a picture", "calibration": "a file, not our folder"}
    for name, text in foreign.items():
        (src / name).write_text(text)
    out = tmp_path / "out"
    convert(src, out, ConvertOptions(method="gptq", num_samples=4, seq_len=32), device="cpu")
    for name, text in foreign.items():
        assert not (out / name).is_file() or (out / name).read_text() != text, name
    assert (out / "calibration").is_dir() and (out / "tokenizer.json").is_file()
    assert verify(src, out).ok
    names = {f.name for f in prepare_push(out, "me/x").files}
    assert "verify.json" in names and "calibration-report.json" in names


HANG = ("{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}")


def test_a_chat_template_that_never_finishes_is_refused_not_waited_for(tmp_path, monkeypatch):
    """tokenizer_config.json's chat template is code from the checkpoint: nested loops that
    would run for hours stop at the bound (shortened here to 1 s) with a message naming the
    file, in a GPTQ convert (before any output), verify's layer check and chat-record
    rendering (on 1d01519 each hung)."""
    import time

    from quantize.calib import data
    from quantize.check.verify import verify
    from quantize.pipeline import convert

    monkeypatch.setattr(data, "TEMPLATE_SECONDS", 1.0)
    cfg = tiny_config("glm4_moe")
    src = write_checkpoint(tmp_path / "src", cfg, "fp8-channel")
    write_tokenizer(src, cfg["vocab_size"])
    tc = json.loads((src / "tokenizer_config.json").read_text())
    tc["chat_template"] = HANG
    (src / "tokenizer_config.json").write_text(json.dumps(tc))
    out = tmp_path / "out"
    convert(src, out, ConvertOptions(), device="cpu")  # rtn: renders no template
    for run in (lambda: convert(src, tmp_path / "gptq", ConvertOptions(method="gptq", num_samples=4,
                                                                       seq_len=32), device="cpu"),
                lambda: verify(src, out)):
        t0 = time.monotonic()
        with pytest.raises(QuantizeError, match="chat template does not finish") as e:
            run()
        assert time.monotonic() - t0 < 60 and "tokenizer_config.json" in str(e.value)
    assert not (tmp_path / "gptq").exists()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    t0 = time.monotonic()
    with pytest.raises(QuantizeError, match="chat template does not finish"):
        data.tokenize_documents([[{"role": "user", "content": "hi"}]], tok)
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("model_type,edit,field", [
    ("glm_moe_dsa", {"rms_norm_eps": -1}, "rms_norm_eps"),
    ("glm4_moe", {"rms_norm_eps": 0}, "rms_norm_eps"),
    ("glm_moe_dsa", {"num_experts_per_tok": 99}, "num_experts_per_tok"),
    ("glm4_moe", {"n_group": 3}, "n_group"),
    ("glm4_moe", {"n_group": 2, "topk_group": 3}, "topk_group"),
    ("glm_moe_dsa", {"rope_theta": "NaN"}, "rope_theta"),
    ("glm4_moe", {"routed_scaling_factor": "Infinity"}, "routed_scaling_factor"),
    ("glm4_moe", {"rope_scaling": {"factor": "-Infinity"}}, "rope_scaling.factor"),
])
def test_configs_that_convert_but_cannot_run_are_refused_up_front(tmp_path, model_type, edit, field):
    """config.json values the layers cannot compute with (a negative norm epsilon, more experts
    per token than exist, expert groups that do not divide, NaN / Infinity, which Python's json
    reads and writes back as null) are refused by `inspect` and `convert` before any output,
    naming the field (on 1d01519: an RTN output, then a TypeError / RuntimeError traceback in
    verify's layer check, or a fresh output whose config said null and failed verify)."""
    cfg = tiny_config(model_type)
    src = write_checkpoint(tmp_path / "src", cfg, "fp8-block" if model_type == "glm_moe_dsa" else "fp8-channel")
    text = (src / "config.json").read_text()
    on_disk = json.loads(text)
    on_disk.update(edit)
    # NaN / Infinity as Python's json writes them (bare words), not as strings
    raw = json.dumps(on_disk, indent=2)
    for word in ("NaN", "Infinity", "-Infinity"):
        raw = raw.replace(f'"{word}"', word)
    (src / "config.json").write_text(raw)
    for args in (["inspect", str(src)], ["convert", str(src), str(tmp_path / "out"), "--device", "cpu"]):
        r = runner.invoke(app, args, env={"COLUMNS": "300"})
        assert r.exit_code == 2, r.output
        assert field in r.output and "config.json" in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_a_legal_long_file_name_in_the_source_converts_and_resumes(tmp_path):
    """A 250-byte non-weight file name is legal (NAME_MAX is 255 bytes) but NAME.partial is not:
    the copy is written under a short temporary name, the conversion finishes and verifies,
    and a re-run of the finished folder passes too (on 1d01519 it failed after every shard,
    each re-run the same way)."""
    from quantize.check.verify import verify
    from quantize.pipeline import convert

    src = write_checkpoint(tmp_path / "src", tiny_config("glm4_moe"), "fp8-channel")
    long = "n" * 245 + ".json"
    (src / long).write_text('{"note": "a long name"}')
    out = tmp_path / "out"
    convert(src, out, ConvertOptions(), device="cpu")
    assert (out / long).read_bytes() == (src / long).read_bytes()
    assert verify(src, out).ok
    assert convert(src, out, ConvertOptions(), device="cpu").written == []
    assert not [p for p in out.iterdir() if p.name.endswith(".partial")]


def test_small_hostile_inputs_are_refused_in_one_line(tmp_path):
    """--tp 0 / -8 refused by the option (on 1d01519: ZeroDivisionError, and -8 reached the
    card); a symlink loop in the source and a config.json that is a FIFO refused with the
    file named (a traceback; inspect / plan blocked for ever); a finished calibrated folder's
    calibration/timings.json turned into a link to /dev/zero does not stop its re-run
    (MemoryError)."""
    import subprocess
    import sys

    src = write_checkpoint(tmp_path / "src", tiny_config("glm4_moe"), "fp8-channel")
    wide = {"COLUMNS": "300"}
    for cmd in ("convert", "plan"):
        for tp in ("0", "-8"):
            args = [cmd, str(src), *([str(tmp_path / "o")] if cmd == "convert" else []), "--tp", tp]
            r = runner.invoke(app, args, env=wide)
            assert r.exit_code == 2 and "--tp" in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "o").exists()

    loop = tmp_path / "loop"
    shutil.copytree(src, loop)
    (loop / "a.json").symlink_to(loop / "b.json")
    (loop / "b.json").symlink_to(loop / "a.json")
    r = runner.invoke(app, ["convert", str(loop), str(tmp_path / "o"), "--device", "cpu"], env=wide)
    assert r.exit_code == 2 and "a.json" in r.output and "links to files outside" in r.output, r.output

    fifo = tmp_path / "fifo"
    shutil.copytree(src, fifo)
    (fifo / "config.json").unlink()
    os.mkfifo(fifo / "config.json")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "COLUMNS": "300"}
    for cmd in ("inspect", "plan"):
        p = subprocess.run([sys.executable, "-m", "quantize", cmd, str(fifo)], env=env,
                           capture_output=True, text=True, timeout=60, check=False)
        assert p.returncode == 2 and "not a regular file" in p.stderr, p.stderr

    cfg = tiny_config("glm4_moe")
    calib_src = write_checkpoint(tmp_path / "csrc", cfg, "fp8-channel")
    write_tokenizer(calib_src, cfg["vocab_size"])
    out = tmp_path / "out"
    args = ["convert", str(calib_src), str(out), "--method", "gptq", "--num-samples", "4",
            "--seq-len", "32", "--device", "cpu"]
    assert runner.invoke(app, args).exit_code == 0
    (out / "calibration" / "timings.json").unlink()
    (out / "calibration" / "timings.json").symlink_to("/dev/zero")
    r = runner.invoke(app, args, env=wide)
    assert r.exit_code == 0, r.output
