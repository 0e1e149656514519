"""SGLang's own loader on our outputs (`make engine-check`, sglang 0.5.23 in .venv-sglang).

Each case converts a tiny GLM-5.x (`glm_moe_dsa`) or GLM-4.x (`glm4_moe`) FP8 checkpoint with
our pipeline (RTN), its config.json saved through transformers as the releases' are (with
`layer_types`, `indexer_types`, ...), then does with the output what SGLang's server does,
through SGLang's own code: `ModelConfig` reads config.json (for the NextN draft the same folder
with `is_draft_model`, which renames the architecture), `_get_quantization_config` builds the
`CompressedTensorsConfig`, the model class (GlmMoeDsaForCausalLM, Glm4MoeForCausalLM and their
NextN drafts) is built as `_initialize_model` builds it, and `DefaultModelLoader` streams our
safetensors through the model's `load_weights`. `process_weights_after_loading` (Marlin /
CUTLASS repacking, CUDA only) is not run: the parameters are compared as the loader wrote them.

The shared-experts fusion is SGLang's loader's choice (`resolve_shared_experts_config`, which
asks the class's `shared_experts_fusion_disable_reason`) as an H100 makes it, for the command
the model card prints: `--disable-shared-experts-fusion` read from it by SGLang's own argument
parser. Each case also runs with the other setting, to show what the card's choice avoids.

Checked under the card's setting, for the target and its draft: every parameter SGLang
allocates (first filled with a sentinel) holds our file's bytes, bit for bit, through
SGLang's fused names (qkv_proj = q|k|v, gate_up_proj = gate|up, fused_qkv_a_proj_with_mqa =
q_a|kv_a, along the output dimension; the experts' w13_* / w2_* stacked over experts, gate|up
per expert, transposed where SGLang marks the parameter `is_transposed` (W4A16: (E, K/8, N));
a fused shared expert is slot E); bf16 tensors in float32 parameters are an exact widening; the
MoE `*_weight_shape` are bf16 (W4A16) or int32 (W4AFP8) parameters, [N, K] checked as such
(exact at these sizes); nothing is left at the sentinel but the never-written g_idx
placeholders (actorder None) and the draft's embed_tokens / lm_head (shared with the target);
every tensor of our file is held by a parameter of the target or the draft. Load paths SGLang
takes only with a GPU are not exercised: on CUDA the DSA indexer's wk and weights_proj (BF16)
go into one fused `wk_weights_proj`.

A layout SGLang cannot load under either setting has no SGLang command on its card (the card
says why and what to convert instead), and `plan` flags it before convert with that fix.
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

# SGLang itself: under make engine-check a missing or broken SGLang fails here, never skips
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.moe.utils import resolve_shared_experts_config
from sglang.srt.model_loader import loader as sgl_loader
from sglang.srt.model_loader.utils import set_default_torch_dtype
from sglang.srt.runtime_context import get_exec, get_model
from sglang.srt.server_args import ServerArgs

from quantize.options import ConvertOptions
from quantize.pipeline import convert
from quantize.plan import make_plan
from quantize.source.checkpoint import open_checkpoint
from quantize.source.synth import tiny_config, write_checkpoint

FUSION_OFF = "--disable-shared-experts-fusion"
H100 = (9, 0)  # the compute capability SGLang's rules are asked at (conftest's patch: the same)
# routed experts of the releases: the fusion rule is asked about these too (GLM-5.x; GLM-4.5-4.7)
RELEASE_EXPERTS = {"glm_moe_dsa": 256, "glm4_moe": 160}
SHARED = frozenset({"routed", "shared"})
ALL = frozenset({"routed", "shared", "dense"})


def glm5(**over) -> dict:
    """A tiny GLM-5.x config with the router fields the releases' config.json carry and SGLang's
    DeepSeek path reads (`moe_layer_freq`, `topk_method`, `scoring_func`)."""
    return tiny_config("glm_moe_dsa", topk_method="noaux_tc", scoring_func="sigmoid",
                       moe_layer_freq=1, n_group=1, topk_group=1, **over)


def glm4(**over) -> dict:
    return tiny_config("glm4_moe", **over)


# groups 64 and 128 need every INT4 K a multiple of the group: the expert width 96 -> 128
WIDE = {"moe_intermediate_size": 128}


@dataclass(frozen=True)
class Case:
    config: dict
    opts: ConvertOptions
    # None: SGLang loads it. Else the option to convert without, which the card and `plan`'s
    # checks must name (SGLang 0.5.23 loads this layout under no setting).
    refused_without: str | None = None


CASES = {
    "glm5-default": Case(glm5(), ConvertOptions()),
    "glm5-shared-g64": Case(glm5(**WIDE), ConvertOptions(targets=SHARED, group_size=64)),
    "glm5-dense-mtp-keep": Case(glm5(), ConvertOptions(targets=ALL, mtp="keep")),
    "glm5-w4afp8": Case(glm5(**WIDE), ConvertOptions(scheme="w4afp8", group_size=128)),
    "glm5-keep-fp8": Case(glm5(), ConvertOptions(keep_fp8=True), "--keep-fp8"),
    "glm4-default": Case(glm4(), ConvertOptions()),
    "glm4-shared-g128": Case(glm4(**WIDE), ConvertOptions(targets=SHARED, group_size=128)),
    "glm4-dense-g64": Case(glm4(**WIDE), ConvertOptions(targets=ALL, group_size=64)),
    "glm4-mtp-keep": Case(glm4(), ConvertOptions(mtp="keep")),
    "glm4-w4afp8": Case(glm4(**WIDE), ConvertOptions(scheme="w4afp8", group_size=128)),
    "glm4-w4afp8-shared": Case(glm4(**WIDE), ConvertOptions(scheme="w4afp8", group_size=128,
                                                              targets=SHARED)),
    "glm4-asymmetric": Case(glm4(), ConvertOptions(symmetric=False), "--asymmetric"),
    "glm4-keep-fp8": Case(glm4(), ConvertOptions(keep_fp8=True), "--keep-fp8"),
}


def write_source(folder: Path, cfg: dict) -> Path:
    """An FP8 release of `cfg` (GLM-5.x block FP8, GLM-4.x channel FP8) whose config.json is
    the one transformers writes for it (every per-layer list included)."""
    from transformers import AutoConfig

    fmt = "fp8-block" if cfg["model_type"] == "glm_moe_dsa" else "fp8-channel"
    src = write_checkpoint(folder, cfg, fmt, seed=3, shard_bytes=2**20)
    on_disk = json.loads((src / "config.json").read_text())
    written = AutoConfig.for_model(cfg["model_type"], **{
        k: v for k, v in on_disk.items() if k not in ("model_type", "quantization_config")})
    (src / "config.json").write_text(json.dumps(
        {**written.to_dict(), "quantization_config": on_disk["quantization_config"]}, indent=2))
    return src


def card_command(card: str) -> list[str] | None:
    """The model card's SGLang command as argv (None: the card prints none)."""
    lines = [ln for ln in card.splitlines() if ln.startswith("python -m sglang.launch_server")]
    assert len(lines) <= 1, lines
    return shlex.split(lines[0])[3:] if lines else None


def disables_fusion(argv: list[str]) -> bool:
    """`--disable-shared-experts-fusion` as SGLang's own argument parser reads `argv` (an
    option SGLang does not know fails here)."""
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(argv).disable_shared_experts_fusion


def read_file(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    return tensors


def fused_on_h100(cls, hf_config, quant_config, disable: bool):
    """SGLang's loader's shared-experts choice (`resolve_shared_experts_config`, which asks the
    class's `shared_experts_fusion_disable_reason`) as an H100 makes it: the rule's `_is_cuda`
    and `torch.cuda.get_device_capability` answer as CUDA at capability 9.0; `disable` is
    `--disable-shared-experts-fusion`."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "get_device_capability", lambda *a, **k: H100)
        for klass in cls.__mro__:
            module = sys.modules[klass.__module__]
            if hasattr(module, "_is_cuda"):
                mp.setattr(module, "_is_cuda", True)
        with get_exec().moe.override(disable_shared_experts_fusion=disable):
            return resolve_shared_experts_config(cls, hf_config, quant_config)


# what every parameter holds before the load: an element still holding it was not written
SENTINEL_FLOAT = float("nan")
SENTINEL_INT = -0x5A5A5A5A

# SGLang's fused module -> our modules, concatenated along the output dimension in this order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "fused_qkv_a_proj_with_mqa": ("q_a_proj", "kv_a_proj_with_mqa")}
EXPERT_PARTS = {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}
# never written, by design: the MoE's activation-order placeholders (our actorder is None)
NEVER_WRITTEN = ("_g_idx", "_g_idx_sort_indices")
# never written in the NextN draft: the embedding and head it shares with the target
DRAFT_SHARED = ("model.embed_tokens.weight", "lm_head.weight")


# what SGLang's model builders and weight loaders raise on a layout they do not take
REFUSALS = (AssertionError, AttributeError, KeyError, NotImplementedError, RuntimeError,
            ValueError)


@dataclass
class Loaded:
    """One SGLang build and load: `problems` is empty when every parameter holds our bytes."""

    fused: int  # shared experts fused into the routed MoE (SGLang's choice)
    fused_at_release_size: int  # the same rule's choice with the release's expert count
    problems: list[str] = field(default_factory=list)
    consumed: set[str] = field(default_factory=set)  # our tensors some parameter holds
    parameters: int = 0


def _file_name(name: str, draft: bool, n_layers: int) -> str:
    """Our file's name for SGLang's `name`: in the NextN draft `model.decoder.*` is the MTP
    layer's decoder block, `model.{eh_proj, enorm, hnorm, shared_head}` its own modules."""
    if not draft:
        return name
    layer = f"model.layers.{n_layers}"
    if name.startswith("model.decoder."):
        return layer + name[len("model.decoder"):]
    return layer + name[len("model"):]


def _sentinel_like(p: torch.Tensor) -> torch.Tensor:
    return torch.full_like(p, SENTINEL_FLOAT if p.is_floating_point() else SENTINEL_INT)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (torch.equal compares no float8, and NaN never equals NaN)."""
    return t.contiguous().view(torch.uint8) if t.is_floating_point() else t


def _experts(p: torch.nn.Parameter, stem: str, leaf: str, file: dict[str, torch.Tensor],
             n_routed: int) -> list[tuple[torch.Tensor | None, list[str]]]:
    """Each expert slot's tensor from our file for SGLang's `w13_*` / `w2_*` parameter `p`, with
    the file names it is made of (None: our file has no such tensors). Slot n_routed, when
    SGLang made it, is the fused shared expert."""
    part, _, suffix = leaf.partition("_")  # "w13", "weight_packed"
    shared = stem.rsplit(".", 1)[0] + ".shared_experts"
    slots = []
    for e in range(p.shape[0]):
        owner = f"{stem}.{e}" if e < n_routed else shared
        names = [f"{owner}.{q}.{suffix}" for q in EXPERT_PARTS[part]]
        if not all(n in file for n in names):
            slots.append((None, names))
        elif suffix == "weight_shape":
            # one [N, K] per expert: gate and up each write theirs, the same, into it
            assert all(torch.equal(file[n], file[names[0]]) for n in names), names
            slots.append((file[names[0]], names))
        else:
            t = torch.cat([file[n] for n in names], dim=0)  # (N, K/8 | K/g | K): gate|up
            slots.append((t.T if getattr(p, "is_transposed", False) else t, names))
    return slots


def _check(name: str, p: torch.Tensor, want: torch.Tensor, source: str) -> str | None:
    """Why `p` does not hold `want` bit for bit (None: it does)."""
    if source.endswith("weight_shape"):
        # int64 [N, K] in our file; SGLang's W4A16 MoE keeps it in the model dtype, its W4AFP8
        # MoE as int32 (values exact at these sizes)
        want = want.to(p.dtype)
    elif p.dtype != want.dtype and p.is_floating_point() and want.is_floating_point():
        # bf16 norms / scales / router weights in float32 parameters: an exact widening
        assert p.dtype.itemsize > want.dtype.itemsize, (name, p.dtype, want.dtype)
        want = want.to(p.dtype)
    if p.shape != want.shape or p.dtype != want.dtype:
        return (f"{name}: SGLang {p.dtype} {tuple(p.shape)} vs our {want.dtype} "
                f"{tuple(want.shape)} from {source}")
    if torch.equal(_bits(p), _bits(want)):
        return None
    if torch.equal(_bits(p), _bits(_sentinel_like(p))):
        return f"{name}: left unwritten (our {source})"
    return f"{name}: differs from our {source}"


def _compare(model, file: dict[str, torch.Tensor], hf_config, draft: bool,
             loaded: Loaded) -> None:
    n_routed, n_layers = hf_config.n_routed_experts, hf_config.num_hidden_layers
    for name, param in model.named_parameters():
        loaded.parameters += 1
        p = param.detach()
        if name.endswith(NEVER_WRITTEN) or (draft and name in DRAFT_SHARED):
            if not torch.equal(_bits(p), _bits(_sentinel_like(p))):
                loaded.problems.append(f"{name}: written, though SGLang never writes it")
            continue
        module, _, leaf = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        if last == "experts" and leaf.startswith(("w13_", "w2_")):
            slots = _experts(param, _file_name(module, draft, n_layers), leaf, file, n_routed)
            for e, (want, names) in enumerate(slots):
                if want is not None:
                    loaded.consumed.update(names)
                if want is None:  # (a fused shared expert that is not INT4 in our file)
                    left = torch.equal(_bits(p[e]), _bits(_sentinel_like(p[e])))
                    why = f"{name}[{e}]: no {names[0]} in our file" + (
                        ", left unwritten" if left else "")
                else:
                    why = _check(f"{name}[{e}]", p[e], want, names[0])
                if why:
                    loaded.problems.append(why)
            continue
        if last in FUSED:
            names = [_file_name(f"{parent}.{q}.{leaf}", draft, n_layers) for q in FUSED[last]]
            if leaf == "weight_shape":  # each shard writes its [N, K] into the one slot in turn
                want = file.get(names[-1])
            else:
                want = torch.cat([file[n] for n in names], 0) if all(
                    n in file for n in names) else None
        else:
            names = [_file_name(name, draft, n_layers)]
            want = file.get(names[0])
        if want is None:
            loaded.problems.append(f"{name}: no {' | '.join(names)} in our file")
            continue
        loaded.consumed.update(names)
        if why := _check(name, p, want, names[0]):
            loaded.problems.append(why)


def sglang_load(out: Path, draft: bool, disable_fusion: bool) -> Loaded:
    """Build SGLang's model for `out` (its NextN draft if `draft`) as SGLang's loader does, with
    the shared-experts setting an H100 picks with or without --disable-shared-experts-fusion,
    load our safetensors through its `load_weights`, and compare every parameter with our file."""
    model_config = ModelConfig(str(out), dtype="bfloat16", is_draft_model=draft)
    load_config = LoadConfig()
    quant_config = sgl_loader._get_quantization_config(model_config, load_config)
    cls, _ = sgl_loader.get_model_architecture(model_config)
    hf_config = model_config.hf_config
    shared = fused_on_h100(cls, hf_config, quant_config, disable_fusion)
    release = copy.deepcopy(hf_config)
    release.n_routed_experts = RELEASE_EXPERTS[hf_config.model_type]
    loaded = Loaded(shared.num_fused_shared_experts, fused_on_h100(
        cls, release, quant_config, disable_fusion).num_fused_shared_experts)
    with get_exec().moe.override(disable_shared_experts_fusion=disable_fusion):
        try:
            # sgl_loader._initialize_model's build, with the choice above
            with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"), \
                    get_model().override(shared_experts=shared):
                model = cls(config=hf_config, quant_config=quant_config)
            model.shared_experts_config = shared
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(_sentinel_like(p))
            loader = sgl_loader.DefaultModelLoader(load_config)
            sgl_loader.DefaultModelLoader.load_weights_only(
                model, loader._get_all_weights(model_config, model), torch.device("cpu"))
        except REFUSALS as e:  # (an outcome under test: SGLang refusing a layout)
            loaded.problems.append(f"SGLang raised {type(e).__name__}: {e}")
            return loaded
    _compare(model, read_file(out), hf_config, draft, loaded)
    return loaded


@dataclass(frozen=True)
class Output:
    src: Path
    out: Path


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """case -> its source and converted output, written on first use."""
    made: dict[str, Output] = {}

    def get(case: str) -> Output:
        if case not in made:
            root = tmp_path_factory.mktemp(case)
            src = write_source(root / "src", CASES[case].config)
            convert(src, root / "int4", CASES[case].opts, device="cpu")
            made[case] = Output(src, root / "int4")
        return made[case]

    return get


def _describe(case: str, draft: bool, disable: bool, card: bool | None, r: Loaded) -> str:
    verdict = "bit-equal" if not r.problems else "; ".join(r.problems[:4]) + (
        f" (+{len(r.problems) - 4})" if len(r.problems) > 4 else "")
    return (f"{case} {'draft ' if draft else 'target'} {FUSION_OFF if disable else '(default)':32}"
            f"{'[card] ' if disable == card else ''}fused {r.fused}: {r.parameters} parameters "
            f"{verdict}")


@pytest.mark.parametrize("case", list(CASES))
def test_sglang_loads_our_output(case, outputs, sglang_runtime):
    c = CASES[case]
    o = outputs(case)
    card = (o.out / "README.md").read_text()
    argv = card_command(card)
    card_off = None if argv is None else disables_fusion(argv)
    runs = {(disable, draft): sglang_load(o.out, draft, disable)
            for disable in (False, True) for draft in (False, True)}
    for (disable, draft), r in runs.items():
        print("\n" + _describe(case, draft, disable, card_off, r), end="")

    if c.refused_without is not None:
        # SGLang loads it under no setting: the card prints no command, says why and the fix,
        # and plan (what convert prints first) flags it with the same fix
        assert argv is None, f"the card prints an SGLang command SGLang cannot load: {argv}"
        assert all(r.problems for r in runs.values()), \
            f"SGLang loads {case} now: let the card print its command and drop the lint rule"
        fix = f"without {c.refused_without}"
        assert fix in card, card
        checks = make_plan(open_checkpoint(o.src), c.opts).checks
        flags = [x for x in checks if x.level == "warn" and "SGLang" in x.detail and fix in x.detail]
        assert flags, [f"{x.level} {x.what}: {x.detail}" for x in checks]
        return

    assert argv is not None, "the card prints no SGLang command for a layout SGLang loads"
    for draft in (False, True):
        r = runs[(card_off, draft)]
        assert not r.problems, "\n".join(r.problems)
        # the tiny config's expert count decides nothing: the release's gets the same choice
        assert r.fused == r.fused_at_release_size, (r.fused, r.fused_at_release_size)
    file = set(read_file(o.out))
    held = runs[(card_off, False)].consumed | runs[(card_off, True)].consumed
    assert held == file, f"our tensors no SGLang parameter holds: {sorted(file - held)}"
    # the other setting: where it does not load, the card says which to use
    if any(runs[(not card_off, draft)].problems for draft in (False, True)):
        notes = [ln for ln in card.splitlines() if FUSION_OFF in ln and not
                 ln.startswith("python -m sglang.launch_server")]
        assert notes, "the card does not say why its SGLang command needs its fusion setting"


def test_layouts_sglang_cannot_load_are_refused_by_the_options():
    """The SGLang constraints our options refuse outright, before any file is read: W4AFP8
    (SGLang's CompressedTensorsW4AFP8MoE reads the group size of the `Linear` group and asserts
    symmetric) at group 128 only, symmetric only; attention is never an INT4 target (an INT4
    q_a / kv_a pair breaks SGLang's fused_qkv_a_proj_with_mqa concatenation, an INT4 kv_b_proj
    its post-load w_kc / w_vc split)."""
    with pytest.raises(ValueError, match="--scheme w4afp8 needs --group-size 128"):
        ConvertOptions(scheme="w4afp8", group_size=32)
    with pytest.raises(ValueError, match="symmetric weights"):
        ConvertOptions(scheme="w4afp8", group_size=128, symmetric=False)
    with pytest.raises(ValueError, match="--targets must be a non-empty subset of routed,shared,dense"):
        ConvertOptions(targets=frozenset({"attention"}))
