"""The CLI through Typer's runner: tables, JSON, exit codes, error messages."""

import json

from typer.testing import CliRunner

from quantize.cli import app

runner = CliRunner()


def test_help_lists_commands_with_examples():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0
    for cmd in ("inspect", "plan", "convert", "verify"):
        assert cmd in r.output
    r = runner.invoke(app, ["convert", "--help"])
    assert "Example" in r.output and "--group-size" in r.output and "--resume" in r.output


def test_help_prose_wraps_at_the_terminal_width():
    """Each command's help paragraphs are reflowed: a sentence the docstring breaks across
    lines reads on one line of a wide terminal, and no line of an 80-column one is a fragment
    left by the docstring's own breaks; the examples keep one command a line."""
    from quantize.cli import COMMANDS

    wide = runner.invoke(app, ["convert", "--help"], env={"COLUMNS": "200"}).output
    assert "each shard is written atomically and recorded in the manifest, so rerunning" in wide
    assert "\n   quantize convert ./GLM-5.2-FP8 ./GLM-5.2-INT4 --recipe recommended" in wide
    for cmd in COMMANDS:
        narrow = runner.invoke(app, [cmd, "--help"], env={"COLUMNS": "80"}).output
        text = "\n".join(line.rstrip() for line in narrow.split("╭")[0].splitlines())
        paras = [p.strip("\n").splitlines() for p in text.split("\n\n") if p.strip()]
        assert paras[0][0].startswith(" Usage:") and len(paras) >= 4, (cmd, paras)
        examples = [p for p in paras if p[0] == " Examples:"]
        assert len(examples) == 1, (cmd, paras)  # each example on its line, indented
        assert all(line.startswith(f"   quantize {cmd} ") for line in examples[0][1:3]), examples
        for lines in paras[1:]:
            if lines[0] != " Examples:":  # prose: its lines fill the width but its last
                short = [line for line in lines[:-1] if len(line) < 60]
                assert not short, (cmd, short)


def test_version_and_short_help():
    """`--version` / `-V` names the package and the libraries it runs with; `-h` is `--help`
    on every command (the hf CLI's conventions)."""
    import compressed_tensors
    import transformers

    from quantize import __version__

    for flag in ("--version", "-V"):
        r = runner.invoke(app, [flag])
        assert r.exit_code == 0
        assert r.output.strip().startswith(f"glm-int4-quantize {__version__} (torch ")
        assert f"transformers {transformers.__version__}" in r.output
        assert f"compressed-tensors {compressed_tensors.__version__}" in r.output
    for cmd in ([], ["convert"], ["verify"], ["push"]):
        r = runner.invoke(app, [*cmd, "-h"])
        assert r.exit_code == 0 and "Usage:" in r.output and "--help" in r.output


def test_header_only_commands_import_no_numeric_library(dsa_fp8, tmp_path):
    """`quantize --version`, `--help`, and `inspect` / `plan` of a source and of an output, as
    processes, load none of torch, transformers or compressed-tensors (versions come from the
    packages' metadata, the rest reads headers): they answer at once (issue 23)."""
    import subprocess
    import sys

    from quantize.options import ConvertOptions
    from quantize.pipeline import convert

    out = tmp_path / "out"
    convert(dsa_fp8, out, ConvertOptions(), device="cpu", tp=1)
    probe = ("import sys\nfrom typer.testing import CliRunner\nfrom quantize.cli import app\n"
             "r = CliRunner().invoke(app, sys.argv[1:])\nassert r.exit_code == 0, r.output\n"
             "print(sorted(m for m in ('torch', 'transformers', 'compressed_tensors') "
             "if m in sys.modules))")
    for args in (["--version"], ["--help"], ["inspect", str(dsa_fp8)], ["inspect", str(out)],
                 ["plan", str(dsa_fp8), "--tp", "1"], ["plan", str(out), "--tp", "1"],
                 ["plan", str(dsa_fp8), "--tp", "1", "--method", "gptq", "--json"]):
        p = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True,
                           check=False)
        assert p.returncode == 0, (args, p.stderr)
        assert p.stdout.strip().splitlines()[-1] == "[]", (args, p.stdout)


def test_inspect_json(dsa_fp8):
    r = runner.invoke(app, ["inspect", str(dsa_fp8), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["format"] == "fp8-block" and d["model_type"] == "glm_moe_dsa"
    assert d["mtp_layers"] == [3] and d["routed_experts_per_layer"] == 8
    assert d["by_role"]["routed"]["dtypes"] == ["F8_E4M3"]


def test_plan_json_and_strict(dsa_fp8):
    r = runner.invoke(app, ["plan", str(dsa_fp8), "--tp", "1", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["quantized_linears"] == 72
    # the routed experts shrink (FP8 -> INT4 + BF16 scales: ~0.56x here), the other FP8
    # Linears double (BF16), the BF16 tensors stay; the total is the sum (exact: test_plan)
    r_src, r_out = d["by_role"]["routed"]["source_bytes"], d["by_role"]["routed"]["output_bytes"]
    assert 0.5 < r_out / r_src < 0.6
    for role in ("attention", "dense", "shared"):
        v = d["by_role"][role]
        assert 1.9 < v["output_bytes"] / v["source_bytes"] < 2.0  # FP8 + 128x128 scales -> BF16
    assert d["by_role"]["router"]["output_bytes"] == d["by_role"]["router"]["source_bytes"]
    assert d["output_bytes"] == sum(v["output_bytes"] for v in d["by_role"].values())
    assert d["calibration"] is None  # rtn
    # gptq: GPTAQ and the scale re-fit apply to dense / shared targets only, and GPTAQ's second
    # stream doubles the calibration checkpoints
    plans = {}
    for k, extra in {"routed": [], "shared": ["--targets", "routed,shared"],
                     "shared-plain": ["--targets", "routed,shared", "--gptaq", "0", "--no-sequential-mlp"],
                     "routed-seq": ["--sequential-mlp"],
                     "shared-seq": ["--targets", "routed,shared", "--sequential-mlp"]}.items():
        r = runner.invoke(app, ["plan", str(dsa_fp8), "--tp", "1", "--method", "gptq", "--json", *extra])
        assert r.exit_code == 0, r.output
        plans[k] = json.loads(r.stdout)
    extras = {k: {a: v for a, v in p["calibration"].items() if a != "clip"} for k, p in plans.items()}
    assert extras["routed"] == {"gptaq": 0, "scale_refit": {}, "sequential_mlp": False}
    assert extras["shared"] == {"gptaq": 0.5, "scale_refit": {"dense/shared": 3}, "sequential_mlp": True}
    assert extras["shared-plain"] == {"gptaq": 0, "scale_refit": {"dense/shared": 3}, "sequential_mlp": False}
    # --sequential-mlp orders dense / shared MLPs: nothing to do with routed targets alone
    assert plans["routed-seq"]["calibration"] == plans["routed"]["calibration"]
    assert plans["shared-seq"]["calibration"] == plans["shared"]["calibration"]
    assert plans["shared"]["disk"]["checkpoint"] == 2 * plans["shared-plain"]["disk"]["checkpoint"] > 0
    r = runner.invoke(app, ["plan", str(dsa_fp8), "--tp", "1", "--method", "gptq", "--targets", "routed,shared"])
    assert "GPTQ beyond the column loop" in r.output and "GPTAQ 0.5 on dense" in r.output, r.output
    assert "re-fitted x3" in r.output and "streams: GPTAQ" in r.output, r.output
    # how the group scales are chosen, per kind of target: at group 32 routed experts keep the
    # activation-weighted clip of power 3, dense and shared-expert Linears the unweighted one of 2
    assert plans["routed"]["calibration"]["clip"] == {"routed": [3, 1.0]}
    assert plans["shared"]["calibration"]["clip"] == {"dense/shared": [2, 0.0], "routed": [3, 1.0]}
    rows = {}
    for k, targets in (("routed", "routed"), ("shared", "routed,shared")):
        r = runner.invoke(app, ["plan", str(dsa_fp8), "--tp", "1", "--method", "gptq", "--targets", targets])
        flat = " ".join(r.output.replace("│", " ").split())  # (a cell wraps at the console's width)
        rows[k] = flat.split("GPTQ group scales ", 1)[1].split(" GPTQ beyond", 1)[0]
    assert rows["routed"] == "MSE clip of error power 3, channels weighted by their activations", rows
    for flags, row in ((["--mse-weight-power-routed", "0.5"],
                        "MSE clip of error power 3, channels weighted by their activations^0.5"),
                       (["--mse-norm", "2", "--mse-weight-power", "0"], "MSE clip of error power 2, channels alike"),
                       (["--no-mse-clip"], "min-max range (no MSE clip)")):
        r = runner.invoke(app, ["plan", str(dsa_fp8), "--tp", "1", "--method", "gptq", *flags])
        flat = " ".join(r.output.replace("│", " ").split())
        assert "GPTQ group scales " + row + " GPTQ beyond" in flat, (flags, r.output)
    assert rows["shared"] == (
        "MSE clip of error power 2, channels alike (dense and shared-expert Linears), of error power 3, "
        "channels weighted by their activations (routed experts)"), rows
    from quantize.plan import clip_words

    assert clip_words(True, {"dense/shared": (2, 0.0), "routed": (3, 1.0)}) == (
        "MSE clip of error power 2, channels alike (dense and shared-expert Linears), of error power 3, "
        "channels weighted by their activations (routed experts)")
    assert clip_words(True, {"dense/shared": (2, 0.5), "routed": (2, 0.5)}) == \
        "MSE clip of error power 2, channels weighted by their activations^0.5"
    assert clip_words(False, {"routed": (3, 1.0)}) == "min-max range (no MSE clip)"
    # expert width 96 at TP 8 breaks the Marlin rule: warning, and exit 1 with --strict
    r = runner.invoke(app, ["plan", str(dsa_fp8), "--tp", "8", "--strict"])
    assert r.exit_code == 1 and "expert width" in r.output


def test_convert_then_verify(dsa_fp8, tmp_path):
    out = tmp_path / "o"
    r = runner.invoke(app, ["convert", str(dsa_fp8), str(out), "--device", "cpu", "--tp", "1"])
    assert r.exit_code == 0, r.output
    assert "done" in r.output and "quantize verify" in r.output
    r = runner.invoke(app, ["verify", str(dsa_fp8), str(out), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["ok"] is True
    # a second convert into the same folder finds the manifest, says so, and keeps every shard
    # (issue 5: re-running the same command resumes); other options are refused in test_resume.py
    r = runner.invoke(app, ["convert", str(dsa_fp8), str(out), "--device", "cpu"])
    assert r.exit_code == 0 and "found a finished conversion" in r.output and " 0 shard(s) written" in r.output
    assert "resuming" not in r.output  # a complete output is not "resumed"
    # the output is not a source: convert says what it is and what to run instead
    r = runner.invoke(app, ["convert", str(out), str(tmp_path / "again")])
    assert r.exit_code == 2 and "an INT4 checkpoint, not a source" in r.output
    assert "quantize verify SRC DST" in r.output


def test_inspect_and_plan_read_an_int4_output(tmp_path):
    """`inspect DST` shows the INT4 scheme, the INT4 Linears by role, the bytes (equal to the
    plan's), the conversion; `plan DST --tp N` the serving checks there (--strict: exit 1)."""
    from collections import Counter

    from quantize.options import ConvertOptions
    from quantize.plan import make_plan
    from quantize.source.checkpoint import open_checkpoint
    from quantize.source.synth import tiny_config, write_checkpoint

    # expert width 512: 512 / TP is a multiple of 64 at TP 1, 2, 4, 8, not at 16
    src = write_checkpoint(tmp_path / "src", tiny_config(moe_intermediate_size=512), "fp8-block")
    out = tmp_path / "o"
    assert runner.invoke(app, ["convert", str(src), str(out), "--device", "cpu", "--tp", "1",
                               "--targets", "routed,shared"]).exit_code == 0
    r = runner.invoke(app, ["inspect", str(out), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    plan = make_plan(open_checkpoint(src), ConvertOptions(targets=frozenset({"routed", "shared"})))
    want = Counter(u.role for u in plan.units if u.action == "quantize")
    assert d["format"] == "pack-quantized INT4" and d["group_size"] == 32 and d["symmetric"] is True
    assert d["int4_linears"] == dict(want) and set(want) == {"routed", "shared"}
    assert d["bytes"] == plan.output_bytes and d["conversion"]["method"] == "rtn"
    assert d["mtp_layers"] == [src_layers := open_checkpoint(src).num_hidden_layers]
    assert d["num_hidden_layers"] == src_layers
    assert d["by_role"]["routed INT4"]["dtypes"] == ["BF16", "I32", "I64"]
    assert d["valid_tp"] == [1, 2, 4, 8]
    r = runner.invoke(app, ["inspect", str(out)], env={"COLUMNS": "250"})
    assert r.exit_code == 0 and "routed INT4" in r.output and "serves at TP 1, 2, 4, 8" in r.output
    r = runner.invoke(app, ["plan", str(out), "--tp", "16", "--strict"], env={"COLUMNS": "250"})
    assert r.exit_code == 1 and "TP 16: fail" in r.output and "expert width" in r.output
    r = runner.invoke(app, ["plan", str(out), "--tp", "8", "--strict"], env={"COLUMNS": "250"})
    assert r.exit_code == 0 and "TP 8: ok" in r.output and "fail" not in r.output


def test_bad_options_are_one_line_errors(dsa_fp8, tmp_path):
    r = runner.invoke(app, ["convert", str(dsa_fp8), str(tmp_path / "o"), "--group-size", "48"])
    assert r.exit_code == 2 and "--group-size must be one of" in r.output
    assert "Traceback" not in r.output
    r = runner.invoke(app, ["plan", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "no such folder" in r.output
    r = runner.invoke(app, ["verify", str(dsa_fp8), str(tmp_path)])
    assert r.exit_code == 2 and "not a finished conversion" in r.output
    r = runner.invoke(app, ["convert", str(dsa_fp8), str(tmp_path / "o"), "--max-shard-size", "5XB"])
    assert r.exit_code == 2 and "--max-shard-size '5XB'" in r.output and "512MiB" in r.output
    assert not (tmp_path / "o").exists()


def test_progress_lines_when_stderr_is_a_log_file(dsa_fp8, tmp_path):
    """Under nohup / Slurm / CI (stderr a file, not a terminal) the run says what it does as it
    goes: a start line (source, destination, bytes, method), then time-stamped lines every 5 %
    of the bytes with rate and time left, then the summary."""
    import itertools
    import re
    import subprocess
    import sys
    from pathlib import Path

    log = tmp_path / "convert.log"
    root = Path(__file__).resolve().parents[1]
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-m", "quantize", "convert", str(dsa_fp8), str(tmp_path / "o"),
                            "--device", "cpu", "--tp", "1"], stdout=f, stderr=subprocess.STDOUT,
                           cwd=root, timeout=300, check=False)
    text = log.read_text()
    assert r.returncode == 0, text
    stamp = r"\d\d:\d\d:\d\d\.\d{3}"
    assert re.search(rf"^{stamp} convert {re.escape(str(dsa_fp8))} -> .*to read, .* method rtn", text, re.MULTILINE)
    pcts = [int(m) for m in re.findall(rf"^{stamp} (\d+)% converted: .* MiB/s, .* min left$", text, re.MULTILINE)]
    assert len(pcts) >= 5 and pcts == sorted(pcts) and pcts[-1] == 100, text
    assert all(b // 5 > a // 5 for a, b in itertools.pairwise(pcts))  # one line per 5 % step at most
    assert "done" in text.split(f"{pcts[-1]}% converted")[-1]


def test_verify_device_auto_and_a_missing_gpu(dsa_fp8, tmp_path):
    """verify takes --device like the other commands: auto (the default) runs where a GPU is
    or on the CPU; cuda on a machine without one is a one-line error with exit 2 (bad input),
    not a traceback with exit 1 (the code of a failed check)."""
    import torch

    out = tmp_path / "o"
    assert runner.invoke(app, ["convert", str(dsa_fp8), str(out), "--device", "cpu", "--tp", "1"]).exit_code == 0
    r = runner.invoke(app, ["verify", str(dsa_fp8), str(out), "--device", "auto", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["ok"] is True, r.output
    if not torch.cuda.is_available():
        r = runner.invoke(app, ["verify", str(dsa_fp8), str(out), "--device", "cuda"])
        assert r.exit_code == 2 and "no GPU" in r.output and "--device cpu" in r.output
        assert "Traceback" not in r.output


def test_choices_in_help_quiet_verbose_and_convert_json(dsa_fp8, tmp_path):
    """`--help` lists the choices of --method / --expert-calibration (Enums) and refuses others
    by name; `-q` drops the progress lines from a log (the result stays), `-v` shows the
    traceback of an error; `convert --json` prints strict JSON with the schema version."""
    import subprocess
    import sys
    from pathlib import Path

    r = runner.invoke(app, ["convert", "--help"], env={"COLUMNS": "200"})
    assert "rtn" in r.output and "awq+gptq" in r.output and "routed" in r.output
    r = runner.invoke(app, ["convert", str(dsa_fp8), str(tmp_path / "x"), "--method", "gtpq"])
    assert r.exit_code == 2 and "gtpq" in r.output and "awq+gptq" in r.output
    assert not (tmp_path / "x").exists()

    root = Path(__file__).resolve().parents[1]
    log = tmp_path / "q.log"
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-m", "quantize", "-q", "convert", str(dsa_fp8),
                            str(tmp_path / "o"), "--device", "cpu", "--tp", "1", "--json"],
                           stdout=subprocess.PIPE, stderr=f, cwd=root, timeout=300, check=False,
                           text=True)
    assert r.returncode == 0, log.read_text()
    import re

    stamped = re.findall(r"^\d\d:\d\d:\d\d\.\d{3} .*$", log.read_text(), re.MULTILINE)
    assert stamped == [], stamped  # no start line, no 5 % lines
    assert "done in" in log.read_text()  # the result stays
    d = json.loads(r.stdout)
    assert d["schema_version"] == 1 and d["method"] == "rtn" and d["output"] == "o"
    assert d["shards_written"] and d["shards_kept"] == [] and d["output_bytes"] > 0

    r = runner.invoke(app, ["-v", "verify", str(dsa_fp8), str(tmp_path / "missing")])
    assert r.exit_code != 0 and r.exception is not None  # raised, not a one-line message
    r = runner.invoke(app, ["verify", str(dsa_fp8), str(tmp_path / "missing")])
    assert r.exit_code == 2 and "error:" in r.output


def test_calibrated_convert_json_leaves_stdout_to_the_json(tmp_path):
    """With --json, a calibrated convert's per-layer table goes to stderr: stdout is exactly the
    JSON summary (it was followed by the table, which broke `quantize convert ... --json | jq`)."""
    import subprocess
    import sys
    from pathlib import Path

    from quantize.source.synth import tiny_config, write_checkpoint, write_tokenizer

    cfg = tiny_config("glm4_moe")
    src = write_checkpoint(tmp_path / "src", cfg, "fp8-channel", seed=3)
    write_tokenizer(src, cfg["vocab_size"])
    args = [sys.executable, "-m", "quantize", "convert", str(src), str(tmp_path / "o"),
            "--method", "gptq", "--num-samples", "4", "--seq-len", "32", "--device", "cpu",
            "--tp", "1", "--json", "--mse-weight-power", "0.5", "--mse-norm-routed", "2"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)  # nothing after it
    assert d["method"] == "gptq" and d["calibration_layers"] == cfg["num_hidden_layers"] + 1
    assert "calibration: gptq, 4 x 32 tokens" in r.stderr  # the table is still shown
    # --mse-weight-power reaches the options; group 32's other defaults stay (error power 2,
    # GPTAQ 0.5), and the run record holds them as resolved, for a replay under later defaults
    # (routed targets: no GPTAQ; --mse-weight-power applies to them too, --mse-norm-routed theirs)
    assert ("method gptq (MSE clip of error power 2, channels weighted by their activations^0.5; "
            "dampening 0.1)") in " ".join(r.stderr.split()), r.stderr
    opts = json.loads((tmp_path / "o" / "quantize-manifest.json").read_text())["options"]
    assert (opts["mse_weight_power"], opts["mse_norm"], opts["gptaq"]) == (0.5, 2, 0.5)
    assert {"mse_norm_routed", "mse_weight_power_routed"}.isdisjoint(opts)  # (equal: left out)
    import tomllib

    rec = tomllib.loads((tmp_path / "o" / "quantize-run.toml").read_text())["convert"]
    assert (rec["mse_weight_power"], rec["mse_norm"], rec["gptaq"], rec["mse_clip"]) == (0.5, 2, 0.5, True)
    assert (rec["mse_weight_power_routed"], rec["mse_norm_routed"]) == (0.5, 2)
    assert "scale_refit" not in rec  # (its default differs by target; a value applies to all)


def test_verify_json_is_strict_with_a_schema_version(dsa_fp8, tmp_path):
    """Reports hold numbers or null, never "inf" strings or NaN (strict parsers read them)."""
    from quantize.check.verify import VERIFY_JSON

    out = tmp_path / "o"
    assert runner.invoke(app, ["convert", str(dsa_fp8), str(out), "--device", "cpu", "--tp", "1"]).exit_code == 0
    assert runner.invoke(app, ["verify", str(dsa_fp8), str(out)]).exit_code == 0

    def strict(text: str):
        return json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))

    rep = strict((out / VERIFY_JSON).read_text())
    assert rep["schema_version"] == 1
    copies = [t for t in rep["tensors"] if t["action"] == "copy"]
    assert copies and all(t["sqnr_db"] is None for t in copies)  # exact: no error, null
    assert all(isinstance(t["sqnr_db"], float) for t in rep["tensors"] if t["action"] == "quantize")
    assert "inf" not in (out / VERIFY_JSON).read_text()
    manifest = strict((out / "quantize-manifest.json").read_text())
    assert manifest["schema_version"] == 1


def test_config_file_run_record_and_replay(dsa_fp8, tmp_path):
    """`--config run.toml` sets convert's options (hyphen or underscore keys, a [convert] table,
    targets as a list; a flag on the command line wins); every run writes its resolved options
    to DST/quantize-run.toml (not uploaded); `--from DST NEW` replays it byte for byte;
    an unknown key is refused by name before anything is written."""
    import tomllib

    from quantize.publish.push import prepare_push

    cfg = tmp_path / "run.toml"
    cfg.write_text('[convert]\ngroup-size = 32\nseed = 5\ntargets = ["routed", "shared"]\ndevice = "cpu"\n'
                   'tp = 1\nmax_shard_size = "1MB"\nasymmetric = true\n')
    a, b = tmp_path / "a", tmp_path / "b"
    r = runner.invoke(app, ["convert", "--config", str(cfg), str(dsa_fp8), str(a), "--tp", "2"])
    assert r.exit_code == 0, r.output
    m = json.loads((a / "quantize-manifest.json").read_text())
    assert m["options"]["group_size"] == 32 and m["options"]["targets"] == ["routed", "shared"]
    assert m["options"]["symmetric"] is False and m["tp"] == 2  # the flag won over the file
    rec = tomllib.loads((a / "quantize-run.toml").read_text())["convert"]
    assert rec["src"] == str(dsa_fp8) and rec["group_size"] == 32 and rec["tp"] == 2
    assert rec["targets"] == "routed,shared" and rec["asymmetric"] is True
    assert rec["mse_clip"] is False and rec["gptaq"] == 0  # resolved: rtn's

    r = runner.invoke(app, ["convert", "--from", str(a), str(b)])
    assert r.exit_code == 0, r.output
    shards = sorted(p.name for p in a.glob("*.safetensors"))
    assert len(shards) > 1 and shards == sorted(p.name for p in b.glob("*.safetensors"))
    assert all((a / n).read_bytes() == (b / n).read_bytes() for n in shards)
    assert json.loads((b / "quantize-manifest.json").read_text())["options"] == m["options"]
    assert runner.invoke(app, ["verify", str(dsa_fp8), str(b)]).exit_code == 0
    assert "quantize-run.toml" not in {f.name for f in prepare_push(b, "me/x", write_card=False).files}

    bad = tmp_path / "bad.toml"
    bad.write_text("grup_size = 64\n")
    wide = {"COLUMNS": "300"}  # (the error box would wrap the path)
    r = runner.invoke(app, ["convert", "--config", str(bad), str(dsa_fp8), str(tmp_path / "c")], env=wide)
    assert r.exit_code == 2 and "grup_size" in r.output and "group_size" in r.output
    assert not (tmp_path / "c").exists()
    r = runner.invoke(app, ["convert", "--from", str(tmp_path), str(tmp_path / "c")], env=wide)
    assert r.exit_code == 2 and "quantize-run.toml" in r.output


def test_a_run_record_from_before_calib_bos_replays_without_it(tmp_path):
    """A calibrated run's record without calib_bos (written before the option: its windows had
    no BOS) replays as --no-calib-bos; a record that has it, and a --config file, keep theirs;
    an rtn record gets nothing (no windows)."""
    import click
    import typer

    from quantize.cli.run_record import RESOLVED_KEYS, config_callback, from_callback

    cmd = typer.main.get_command(app).commands["convert"]
    for body, want in (('method = "gptq"\nseed = 2\n', False), ('method = "gptq"\ncalib_bos = true\n', True),
                       ('method = "rtn"\n', None)):
        (tmp_path / "quantize-run.toml").write_text("[convert]\n" + body)
        ctx = click.Context(cmd)
        from_callback(ctx, tmp_path)
        assert ctx.default_map.get("calib_bos") is want, body
    (tmp_path / "c.toml").write_text('[convert]\nmethod = "gptq"\n')
    ctx = click.Context(cmd)
    config_callback(ctx, tmp_path / "c.toml")
    assert "calib_bos" not in ctx.default_map  # a --config file: today's default

    # beside the run's manifest: what the record leaves out is what the manifest recorded the
    # run resolved (a group-32 run from before the group-32 defaults: the weighted clip of
    # power 3, GPTAQ 0.375, BOS windows), not today's group-32 defaults; what it holds stays
    from quantize.options import ConvertOptions
    from quantize.write.manifest import MANIFEST

    ran = ConvertOptions(method="gptq", mse_norm=3, mse_weight_power=1.0, gptaq=0.375, sequential_mlp=False)
    assert ran != ConvertOptions(method="gptq")
    (tmp_path / MANIFEST).write_text(json.dumps({"status": "complete", "files": {}, "options": ran.to_json()}))
    (tmp_path / "quantize-run.toml").write_text('[convert]\nmethod = "gptq"\ngptaq = 0.25\n')
    ctx = click.Context(cmd)
    from_callback(ctx, tmp_path)
    m = ctx.default_map
    assert (m["mse_clip"], m["mse_norm"], m["mse_weight_power"], m["sequential_mlp"]) == (True, 3, 1.0, False)
    assert (m["mse_norm_routed"], m["mse_weight_power_routed"], m["calib_bos"]) == (3, 1.0, True)
    assert m["gptaq"] == 0.25  # (the record's own)
    replay = ConvertOptions(method="gptq", gptaq=0.375, **{k: m[k] for k in RESOLVED_KEYS if k != "gptaq"})
    assert replay == ran


def test_options_the_method_ignores_are_refused_by_name(dsa_fp8, tmp_path):
    """`convert SRC DST --num-samples 512 --calib shipped:small` (no --method: rtn) would round
    to nearest and ignore both: refused with exit 2, naming them and the fix, before anything
    is written; so are GPTQ's options with --method awq. The same values from a --config file
    (or a --from record, which holds every option) stay accepted:
    test_config_file_run_record_and_replay."""
    wide = {"COLUMNS": "300"}
    out = tmp_path / "o"
    r = runner.invoke(app, ["convert", str(dsa_fp8), str(out), "--num-samples", "512",
                            "--calib", "shipped:small"], env=wide)
    assert r.exit_code == 2, r.output
    assert "--calib, --num-samples apply to the calibrated methods" in r.output
    assert "Add --method gptq" in r.output and not out.exists()
    r = runner.invoke(app, ["convert", str(dsa_fp8), str(out), "--method", "rtn", "--seed", "3"], env=wide)
    assert r.exit_code == 2 and "--seed applies to the calibrated methods" in r.output
    r = runner.invoke(app, ["convert", str(dsa_fp8), str(out), "--no-calib-bos"], env=wide)
    assert r.exit_code == 2 and "--calib-bos applies to the calibrated methods" in r.output
    r = runner.invoke(app, ["convert", str(dsa_fp8), str(out), "--method", "awq", "--percdamp", "0.05",
                            "--mse-norm", "2", "--num-samples", "8"], env=wide)
    assert r.exit_code == 2 and "--percdamp, --mse-norm apply to GPTQ" in r.output, r.output
    assert "--num-samples" not in r.output.split("apply to")[0] and not out.exists()


def test_replay_from_another_folder_converts_the_recorded_source(tmp_path, monkeypatch):
    """A run record keeps a local SRC resolved: `--from` run from another working folder, where
    the same relative name is another model, replays the recorded source (on 1d01519 it
    converted whatever the name meant there)."""
    import tomllib

    from quantize.source.synth import tiny_config, write_checkpoint

    one, two = tmp_path / "one", tmp_path / "two"
    write_checkpoint(one / "model", tiny_config("glm4_moe"), "fp8-channel", seed=1)
    write_checkpoint(two / "model", tiny_config("glm4_moe"), "fp8-channel", seed=2)
    monkeypatch.chdir(one)
    r = runner.invoke(app, ["convert", "model", str(tmp_path / "a"), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    rec = tomllib.loads((tmp_path / "a" / "quantize-run.toml").read_text())["convert"]
    assert rec["src"] == str((one / "model").resolve())
    monkeypatch.chdir(two)
    r = runner.invoke(app, ["convert", "--from", str(tmp_path / "a"), str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    shards = sorted(p.name for p in (tmp_path / "a").glob("*.safetensors"))
    assert shards and all((tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes()
                          for n in shards)


def test_user_text_prints_as_itself_never_as_markup(tmp_path):
    """Paths and names are the user's text: a folder named with rich markup (`[/]`, `[red]`) or
    an emoji code (`:train:`) prints literally in results, progress, messages and errors (on
    1d01519 `[/]` crashed with a traceback, once after a complete convert, and `:train:` printed
    as an emoji)."""
    from quantize.source.synth import tiny_config, write_checkpoint

    name = "GLM [/] [red]x[/red] :train:"
    src = write_checkpoint(tmp_path / f"{name} FP8", tiny_config("glm4_moe"), "fp8-channel")
    dst = tmp_path / f"{name} INT4"
    wide = {"COLUMNS": "400"}
    for args in (["inspect", str(src)], ["plan", str(src)],
                 ["convert", str(src), str(dst), "--device", "cpu"], ["verify", str(src), str(dst)],
                 ["inspect", str(dst)]):
        r = runner.invoke(app, args, env=wide)
        assert r.exit_code == 0, (args, r.output, r.exception)
        assert "🚆" not in r.output
    r = runner.invoke(app, ["convert", str(src), str(src / "inside [/]"), "--device", "cpu"], env=wide)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert f"{name} FP8/inside [/]" in r.output and "🚆" not in r.output, r.output


def test_a_missing_dependency_is_one_line_with_the_install_command(tmp_path):
    """Without torch (here: `import torch` made to fail as in an environment without it),
    convert and verify say which package to install in one line, exit 2, no traceback (on
    1d01519: ModuleNotFoundError tracebacks); --version still answers."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from quantize.source.synth import tiny_config, write_checkpoint

    src = write_checkpoint(tmp_path / "src", tiny_config("glm4_moe"), "fp8-channel")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "300"}
    code = "import sys; sys.modules['torch'] = None; from quantize.cli import main; main()"
    for args in (["convert", str(src), str(tmp_path / "o")], ["verify", str(src), str(tmp_path / "o")]):
        r = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                           text=True, check=False, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "needs torch" in r.stderr and "pip install torch" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-c", code, "--version"], env=env, capture_output=True,
                       text=True, check=False, timeout=60)
    assert r.returncode == 0 and "glm-int4-quantize" in r.stdout


def test_convert_help_fits_a_screen_and_help_all_shows_everything():
    """`convert --help` shows the everyday options (method, group size, targets, calibration
    data, samples, length, device, resume / overwrite, GPU memory, json, the recipe) in well
    under 80 lines of a 100-column terminal; the research settings only with --help-all, where
    every option is listed; a hidden option still works."""
    import subprocess
    import sys

    env = {"COLUMNS": "100"}
    short = runner.invoke(app, ["convert", "--help"], env=env).output
    assert len(short.splitlines()) < 70, len(short.splitlines())
    for opt in ("--recipe", "--method", "--group-size", "--targets", "--calib", "--num-samples",
                "--seq-len", "--device", "--resume", "--overwrite", "--max-gpu-memory", "--json",
                "--help-all"):
        assert opt in short, opt
    assert "--gptaq" not in short and "--mse-norm" not in short
    # --help-all is decided when the options are declared (the command line at import): a process
    r = subprocess.run([sys.executable, "-m", "quantize", "convert", "--help-all"], capture_output=True,
                       text=True, check=False, timeout=120, env={**__import__("os").environ, **env})
    assert r.returncode == 0
    for opt in ("--gptaq", "--mse-norm", "--scale-refit", "--expert-coverage", "--mtp", "--scheme",
                "--keep-fp8", "--asymmetric", "--tp", "--config", "--from", "--checkpoint-interval"):
        assert opt in r.stdout, opt


def test_the_recommended_recipe_is_gptq_512_by_2048_and_flags_win(tmp_path):
    """`--recipe recommended` means --method gptq --num-samples 512 --seq-len 2048; a flag given
    as well wins (here the method, and the sizes of a quick calibrated run)."""
    import tomllib

    from quantize.source.synth import tiny_config, write_checkpoint, write_tokenizer

    cfg = tiny_config("glm4_moe")
    src = write_checkpoint(tmp_path / "src", cfg, "fp8-channel")
    write_tokenizer(src, cfg["vocab_size"])
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "a"), "--recipe", "recommended",
                            "--method", "rtn", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    rec = tomllib.loads((tmp_path / "a" / "quantize-run.toml").read_text())["convert"]
    assert (rec["method"], rec["num_samples"], rec["seq_len"]) == ("rtn", 512, 2048)
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "b"), "--recipe", "recommended",
                            "--num-samples", "4", "--seq-len", "32", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    rec = tomllib.loads((tmp_path / "b" / "quantize-run.toml").read_text())["convert"]
    assert (rec["method"], rec["num_samples"], rec["seq_len"]) == ("gptq", 4, 32)


def test_a_log_file_gets_lines_not_a_bar_and_a_calibrated_eta_by_layers(tmp_path):
    """stderr into a file (nohup, Slurm): time-stamped lines and no progress bar drawn into it;
    an RTN run's lines say the time left from the bytes, a calibrated run's say it per layer
    (its time goes by layers: the bytes' estimate said 2.3 -> 3.0 min left for a 0.8 min run)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from quantize.source.synth import tiny_config, write_checkpoint, write_tokenizer

    cfg = tiny_config("glm4_moe")
    src = write_checkpoint(tmp_path / "src", cfg, "fp8-channel")
    write_tokenizer(src, cfg["vocab_size"])
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "COLUMNS": "200"}
    logs = {}
    for method, extra in (("rtn", []), ("gptq", ["--num-samples", "4", "--seq-len", "32"])):
        with open(tmp_path / f"{method}.log", "w") as f:
            r = subprocess.run([sys.executable, "-m", "quantize", "convert", str(src), str(tmp_path / method),
                                "--method", method, "--device", "cpu", "--max-shard-size", "200KB", *extra],
                               env=env, stdout=subprocess.DEVNULL, stderr=f, check=False, timeout=300)
        logs[method] = (tmp_path / f"{method}.log").read_text()
        assert r.returncode == 0, logs[method]
        assert "━" not in logs[method] and "% converted" in logs[method]
    assert "min left" in logs["rtn"]
    pct = [x for x in logs["gptq"].splitlines() if "% converted" in x]
    assert pct and not any("min left" in x for x in pct)
    assert f"1 of {cfg['num_hidden_layers']} decoder layers, ~" in logs["gptq"]
