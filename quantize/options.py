"""The one frozen set of conversion options, validated once and passed explicitly."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from quantize.source.layout import ROLES

__all__ = ["ConvertOptions", "parse_size"]

METHODS = ("rtn", "gptq", "awq", "awq+gptq")
GPTAQ_DEFAULT = 0.375  # ConvertOptions.gptaq for gptq and awq+gptq (with sequential_mlp)
# At group 32 (the default group size) GPTQ's defaults differ from those of groups 64 and 128:
# the MSE clip unweighted (mse_weight_power 0) with error power 2, and GPTAQ 0.5. On
# Gemma-3-270M at 256 x 512 tokens they won seed 0's validation (mean KL 0.0932 against the
# old default's 0.0982) and over five seeds added 10.4 % perplexity out of domain against
# 13.6 %, 3.9 % in domain against 4.4 % (BENCHMARKS.md, "The clip unweighted at group 32").
# At group 128 the same settings were worse out of domain (15.1-18.4 % against 12.8 %).
# Those were dense MLP Linears. Routed experts keep the activation-weighted clip of power 3 at
# every group size (ROUTED_CLIP_DEFAULTS): on the tiny GLM MoE models, whose post-attention
# norms carry outlier channels as real models' do, the unweighted clip on the routed experts
# raised the held-out KL by 15 % in 18 of 18 runs, and changed nothing without the outliers
# (benchmarks/history/scripts/bench_tiny_glm.py; BENCHMARKS.md, "Held-out error on the tiny synthetic GLM models").
SMALL_GROUP = 32
SMALL_GROUP_DEFAULTS = {"mse_norm": 2, "mse_weight_power": 0.0, "gptaq": 0.5}
ROUTED_CLIP_DEFAULTS = {"mse_norm_routed": 3, "mse_weight_power_routed": 1.0}
# The routed experts' clip options, each with the option it follows when not given (and when a
# manifest from before them lacks it: the clip's settings then applied to every target).
ROUTED_OF = {"mse_norm_routed": "mse_norm", "mse_weight_power_routed": "mse_weight_power"}
SCALE_REFIT_DEFAULT = 3  # ConvertOptions.scale_refit (dense and shared-expert Linears), the same
EXPERT_CALIBRATION = ("routed", "routed-weighted", "all")
GROUP_SIZES = (32, 64, 128)  # what vLLM's Marlin / SGLang WNA16 MoE kernels accept
# w4a16: INT4 weights, BF16 activations (Marlin / Machete / WNA16 kernels). w4afp8: the same
# packed INT4 weights (group 128, symmetric) with dynamic per-token FP8 input activations
# declared: vLLM's CompressedTensorsW4A8Fp8MoEMethod, SGLang's CompressedTensorsW4AFP8MoE
# (CUTLASS, Hopper).
SCHEMES = ("w4a16", "w4afp8")
# The MTP (speculative-decoding) layer's Linears: int4 like the decoder layers' (the seed's
# layout), or keep: as in the source (BF16; FP8 widened), which published runs found keeps the
# draft's acceptance rate (an INT4 MTP head has been reported collapsing it to 0-4 %).
MTP_POLICIES = ("int4", "keep")


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000, '512MiB' -> 536870912, '1000' -> 1000 (bytes)."""
    t = text.strip().upper().replace(" ", "")
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "K": 10**3, "M": 10**6, "G": 10**9, "B": 1}
    try:
        for u, mult in units.items():
            if t.endswith(u):
                return int(float(t[: -len(u)]) * mult)
        return int(t)
    except ValueError:
        raise ValueError(f"--max-shard-size {text!r}: expected a number of bytes with an optional "
                         "unit (B, KB, MB, GB, KiB, MiB, GiB), e.g. 5GB or 512MiB") from None


# --expert-coverage at most: each expert's candidates are held on the device through a layer's
# first pass, experts x N x hidden values (GLM-5.2 at 1024: 3.2 GB of bf16, twice that while
# a chunk's are merged in)
MAX_EXPERT_COVERAGE = 1024

# Options the manifest leaves out at these values (to_json), as versions before them wrote it;
# Manifest.resume reads a missing one as this value.
OMITTED_AT = {"rtn_fallback": False, "mse_weight_power": 1.0, "expert_coverage": 0,
              "calib_bos": False, "stats_prefix": True}


def recorded_option(options: dict, key: str):
    """An option as a manifest's `options` record it: a routed-expert clip option left out
    reads as the option it follows (ROUTED_OF: equal, or a manifest from before it), any
    other one left out as OMITTED_AT's value."""
    if key in options:
        return options[key]
    if key in ROUTED_OF:
        return recorded_option(options, ROUTED_OF[key])
    return OMITTED_AT.get(key)


@dataclass(frozen=True)
class ConvertOptions:
    method: str = "rtn"
    # 32: the layout behind the published GLM-5.2 INT4 result; 64/128 trade accuracy for size.
    group_size: int = 32
    # Symmetric is what SGLang's MoE WNA16 path asserts and what transformers decompresses right.
    symmetric: bool = True
    # Routed experts hold ~95% of GLM-5.2's bytes; everything else stays BF16 by default.
    targets: frozenset[str] = field(default_factory=lambda: frozenset({"routed"}))
    # 5 GB shards: the Hub's recommended maximum file size.
    max_shard_size: int = 5 * 10**9
    num_bits: int = 4
    # Calibration (methods other than rtn). None: the shipped default set (calib.data.DEFAULT_CALIB).
    calib: str | None = None
    # 128 x 2048 = 262k tokens: GPTQ's Hessians settle well before that; GLM-5.2 top-8 over
    # 256 experts gives each expert ~8k routed tokens on average.
    num_samples: int = 128
    seq_len: int = 2048
    seed: int = 0
    # Each calibration window begins with the tokens every served request begins with
    # (calib.data.tokenizer_prefix: the tokenizer's BOS, Gemma's and Llama's; else the special
    # tokens the chat template writes before any message, GLM's [gMASK]<sop>; else nothing),
    # then seq_len minus that many tokens of the text. False:
    # windows cut from the text alone (before 2026-12-05; a manifest without the key); rtn: False.
    calib_bos: bool = True
    # The prefix positions (calib_bos) in the MLP statistics (Hessians, GPTAQ's cross terms,
    # AWQ's samples). Every window's prefix is the same tokens, so its hidden states are one
    # vector repeated, which in a few channels dwarfs the text's (Gemma-3's down_proj: 58-86 %
    # of the diagonal). False: the statistics from the text positions alone (the layer
    # outputs still carry the prefix). An option for the benchmark's rows, not a CLI flag.
    stats_prefix: bool = True
    # routed: each expert's statistics from the tokens routed to it (the true distribution);
    # routed-weighted: the same tokens, each weighted by its squared routing weight (the
    # expert's output is scaled by that weight, so its rounding error reaches the layer output
    # scaled by it: sum_t w_t^2 x_t x_tᵀ is that error's Hessian);
    # all: every expert sees every token (llm-compressor's approach), gate/up Hessian shared.
    expert_calibration: str = "routed"
    # Below this many routed tokens an expert's statistics come from all tokens instead
    # (a Hessian of rank < 16 over 2048+ inputs is mostly the dampening term).
    min_expert_tokens: int = 16
    # Routed experts' statistics topped up to at least this many tokens: an expert routed
    # fewer gets the tokens its router logit ranks highest among the rest (the ones the router
    # nearly sent it), instead of the all-token fallback (calib/coverage.py). 0: off.
    expert_coverage: int = 0
    # GPTQ dampening, relative to the mean Hessian diagonal (IST-DASLab `percdamp`). 0.1, not
    # the papers' 0.01: on SmolLM2 (scripts/bench_quality.py, BENCHMARKS.md) 0.01 overfits the
    # calibration text (held-out perplexity worse than RTN's out of domain); 0.1 with mse_clip
    # beats 0.01 out of domain at both group sizes and both calibration sets; on Gemma-3-270M
    # (off the 4-bit grid) 0.1 had the lower validation KL at group 128 (BENCHMARKS.md).
    percdamp: float = 0.1
    # GPTQ against (1 - hessian_shrink) H + hessian_shrink diag(H): the Hessian's cross-channel
    # terms, which GPTQ's compensation fits to the calibration text, shrunk toward its
    # diagonal (gptq.py `GPTQConfig.shrink`). 0: plain GPTQ.
    hessian_shrink: float = 0.0
    # Passes of coordinate descent on GPTQ's codes after each column loop, scales kept: every
    # code moved to the level that lowers the layer's calibration error most (gptq.py
    # `descend_codes`). 0: off (plain GPTQ). Measured on Gemma-3-270M at group 32 (2 passes,
    # BENCHMARKS.md "The five-text out-of-domain pool on this machine"): a lower in-domain KL,
    # a higher out-of-domain perplexity added (1.12x): a closer fit to the calibration text.
    descend: int = 0
    # GPTQ group scales from the clipped range (1.00 ... 0.80) x [min, max] that minimizes the
    # group's Hessian-weighted error (power mse_norm), instead of the full range (gptq.py `mse_clip`).
    # None: on for gptq and awq+gptq (held-out perplexity added 11-14 % -> 3-5 % in domain on
    # SmolLM2, whose weights sit on a 4-bit grid; on Gemma-3-270M, off it, with mse_norm 3 a
    # lower validation KL than no clip at groups 32 and 128), off (not applicable) for rtn, awq.
    mse_clip: bool | None = None
    # The power of the error the MSE clip minimises, sum H_kk^a |w - q|^mse_norm, 2 or 3, on
    # dense and shared-expert Linears (routed experts: mse_norm_routed). None: 2 at group 32
    # with the clip on (SMALL_GROUP_DEFAULTS), else 3. On Gemma-3-270M (weights off the 4-bit
    # grid; scripts/bench_quality.py, BENCHMARKS.md) 3 had the lowest validation KL of the
    # H-weighted clips at groups 32 and 128 (3 seeds).
    mse_norm: int | None = None
    # The power a of diag(H) that weighs each input channel in the clip's error (dense and
    # shared-expert Linears; routed experts: mse_weight_power_routed): 1 the output error
    # (gptq.py `GPTQConfig.mse_weight_power`), 0 unweighted, as llm-compressor's `mse` observer.
    # None: 0 at group 32 with the clip on (SMALL_GROUP_DEFAULTS), else 1.
    mse_weight_power: float | None = None
    # The MSE clip's settings on routed experts. None: mse_norm's and mse_weight_power's where
    # those are given, else 3 and 1 (ROUTED_CLIP_DEFAULTS: the activation-weighted clip, at
    # every group size).
    mse_norm_routed: int | None = None
    mse_weight_power_routed: float | None = None
    # Rounds of GPTQ's group scales re-fitted by least squares to the chosen codes against the
    # Hessian (gptq.py `refit_scales`, `GPTQConfig.scale_refit`), on dense and shared-expert
    # Linears; `scale_refit_routed` on routed experts. None: 3 and 0 for gptq and awq+gptq (with
    # GPTAQ 0.25, before sequential_mlp, the validation choice on Gemma-3-270M at groups 32 and
    # 128; not measured again since; on a GLM-5.2 MoE
    # layer three rounds take 120 s instead of 14: BENCHMARKS.md), 0 for rtn and awq. An explicit
    # `scale_refit` with `scale_refit_routed` unset applies to every target.
    scale_refit: int | None = None
    scale_refit_routed: int | None = None
    # Asymmetric calibration (GPTAQ): GPTQ fits each dense / shared-expert Linear to the
    # unrounded model's outputs, not to the unrounded layer's on the rounded model's inputs;
    # the fraction of that step taken, 0 (off) to 1; a second stream of hidden states is
    # carried where such a Linear is a target (gptq.py `gptaq_target`, Plan.gptaq_active).
    # None: 0.5 at group 32 (SMALL_GROUP_DEFAULTS); else 0.375 for gptq and awq+gptq, with
    # sequential_mlp the validation choice on
    # Gemma-3-270M over groups 32 and 128 (3 seeds; 0.5 next, 0.25 and 0.125 behind it;
    # without sequential_mlp 0.25 was best, and 0.75 worse than none, 1 broke the model:
    # BENCHMARKS.md), 0 (not applicable) for rtn and awq.
    gptaq: float | None = None
    # GPTQ in order within a dense / shared-expert MLP: down_proj's Hessian (and with GPTAQ its
    # D term) from the intermediate activations of the rounded gate/up, as the next Linear sees
    # them, instead of the unrounded ones (the GPTQ authors' "true sequential";
    # round_layer.LayerRounding `_sequential_down`). Routed experts keep pass 1's statistics.
    # None: on for gptq and awq+gptq (Gemma-3-270M: lower validation KL at groups 32 and 128
    # at every GPTAQ fraction but 0.125; a GLM-5.2 dense layer at 512 x 2048 +1.6 s), off
    # (not applicable) for rtn and awq.
    sequential_mlp: bool | None = None
    # the serving scheme the config declares (SCHEMES); the INT4 integers are the same
    scheme: str = "w4a16"
    mtp: str = "int4"
    # Non-target FP8 Linears stay FP8 with their scales (a second, float-quantized config
    # group) instead of being widened to BF16: GLM-5.2 704 -> 404.3 GiB instead of 419.9.
    keep_fp8: bool = False
    # A calibrated layer whose output error exceeds round-to-nearest's on the same tokens by
    # calibrate.REGRESSION_MARGIN stops the run; with this, that layer is rounded to nearest
    # instead (the calibration report and the card list it).
    rtn_fallback: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {self.method!r}")
        self._resolve_gptq_defaults()
        self._check_values()

    def _resolve_gptq_defaults(self) -> None:
        """The calibration options left None, resolved once (frozen) from the method, the
        group size and the options given; a GPTQ option given to a method without GPTQ is
        refused here, before a default could hide it."""
        if self.mse_clip is None:
            object.__setattr__(self, "mse_clip", "gptq" in self.method)
        if "gptq" not in self.method and (self.scale_refit or self.scale_refit_routed):
            # (verify would accept re-fitted scales from a method that never re-fits them)
            raise ValueError("--scale-refit re-fits GPTQ's scales: use it with --method gptq or "
                             "awq+gptq")
        routed = self.scale_refit_routed
        if routed is None:
            routed = 0 if self.scale_refit is None else self.scale_refit
        if self.scale_refit is None:
            object.__setattr__(self, "scale_refit", SCALE_REFIT_DEFAULT if "gptq" in self.method else 0)
        object.__setattr__(self, "scale_refit_routed", routed if "gptq" in self.method else 0)
        for k in ("mse_weight_power", "mse_weight_power_routed"):
            if getattr(self, k) not in (None, 1) and not self.mse_clip:
                flag = "--" + k.replace("_", "-")
                raise ValueError(f"{flag} weighs the MSE clip's error: use it with the clip on "
                                 "(--method gptq or awq+gptq, --mse-clip)")
        for routed, k in ROUTED_OF.items():  # (before k's own default: a k given applies to all)
            if getattr(self, routed) is None:
                given = getattr(self, k)
                object.__setattr__(self, routed, ROUTED_CLIP_DEFAULTS[routed] if given is None else given)
        small = self.group_size == SMALL_GROUP and "gptq" in self.method
        if self.gptaq is None:
            object.__setattr__(self, "gptaq", (SMALL_GROUP_DEFAULTS["gptaq"] if small else GPTAQ_DEFAULT)
                               if "gptq" in self.method else 0.0)
        for k, other in (("mse_norm", 3), ("mse_weight_power", 1.0)):  # (the clip off: its
            if getattr(self, k) is None:  # settings stay at what manifests recorded before)
                object.__setattr__(self, k, SMALL_GROUP_DEFAULTS[k] if small and self.mse_clip else other)
        if self.sequential_mlp is None:
            object.__setattr__(self, "sequential_mlp", "gptq" in self.method)
        if self.method == "rtn":  # no calibration windows (not applicable: not recorded)
            object.__setattr__(self, "calib_bos", False)

    def _check_values(self) -> None:
        """Each option's range, and the combinations the method, scheme and kernels refuse."""
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"--group-size must be one of {GROUP_SIZES} (what the serving "
                             f"kernels accept), got {self.group_size}")
        bad = set(self.targets) - set(ROLES)
        if bad or not self.targets:
            raise ValueError(f"--targets must be a non-empty subset of {','.join(ROLES)}, "
                             f"got {','.join(sorted(self.targets)) or '(empty)'}")
        if self.max_shard_size < 1:
            raise ValueError("--max-shard-size must be positive")
        if self.expert_calibration not in EXPERT_CALIBRATION:
            raise ValueError(f"--expert-calibration must be one of {', '.join(EXPERT_CALIBRATION)}, "
                             f"got {self.expert_calibration!r}")
        if self.num_samples < 1 or self.seq_len < 1:
            raise ValueError("--num-samples and --seq-len must be positive")
        if self.min_expert_tokens < 0:
            raise ValueError("--min-expert-tokens must be >= 0")
        if not 0 <= self.expert_coverage <= MAX_EXPERT_COVERAGE:
            raise ValueError(f"--expert-coverage must be 0 (off) to {MAX_EXPERT_COVERAGE} tokens "
                             f"(its candidates are held through each layer's first pass), got "
                             f"{self.expert_coverage}")
        if self.expert_coverage and ("gptq" not in self.method or self.expert_calibration == "all"):
            raise ValueError(f"--expert-coverage tops up the routed experts' GPTQ statistics: it "
                             f"applies to --method gptq or awq+gptq with --expert-calibration "
                             f"routed or routed-weighted (got --method {self.method}, "
                             f"--expert-calibration {self.expert_calibration})")
        if not 0 < self.percdamp < 1:
            raise ValueError("--percdamp must be in (0, 1)")
        if not 0 <= self.hessian_shrink < 1:
            raise ValueError(f"--hessian-shrink must be in [0, 1), got {self.hessian_shrink}")
        if not 0 <= self.descend <= 8:
            raise ValueError(f"descend must be 0 (off) to 8 passes, got {self.descend}")
        if self.descend and "gptq" not in self.method:
            raise ValueError("descend refines GPTQ's codes: use it with --method gptq or awq+gptq")
        for v in (self.scale_refit, self.scale_refit_routed):
            if not 0 <= v <= 8:
                raise ValueError(f"--scale-refit must be 0 (off) to 8 rounds, got {v}")
        if not 0 <= self.gptaq <= 1:
            raise ValueError(f"--gptaq must be a fraction from 0 (off) to 1, got {self.gptaq}")
        if self.gptaq and "gptq" not in self.method:
            raise ValueError("--gptaq moves GPTQ's targets: use it with --method gptq or awq+gptq")
        for k in ("mse_norm", "mse_norm_routed"):
            if getattr(self, k) not in (2, 3):
                raise ValueError(f"--{k.replace('_', '-')} must be 2 or 3, got {getattr(self, k)}")
        for k in ("mse_weight_power", "mse_weight_power_routed"):
            if not 0 <= getattr(self, k) <= 1:
                raise ValueError(f"--{k.replace('_', '-')} must be in [0, 1], got {getattr(self, k)}")
        if not self.stats_prefix and not self.calib_bos:
            raise ValueError("stats_prefix off leaves the calibration windows' prefix out of the "
                             "statistics: it needs calibrated windows that begin with one "
                             "(a method other than rtn, calib_bos on)")
        if self.mse_clip and "gptq" not in self.method:
            raise ValueError("--mse-clip chooses GPTQ's group scales: use it with --method gptq "
                             "or awq+gptq")
        if self.sequential_mlp and "gptq" not in self.method:
            raise ValueError("--sequential-mlp orders GPTQ's solves: use it with --method gptq or "
                             "awq+gptq")
        if self.rtn_fallback and self.method == "rtn":
            raise ValueError("--rtn-fallback applies to calibrated methods (gptq, awq, awq+gptq)")
        if self.num_bits != 4:
            raise ValueError("only 4-bit weights are supported")
        if self.calib is not None and os.path.exists(self.calib) and \
                not (os.path.isfile(self.calib) or os.path.isdir(self.calib)):
            raise ValueError(f"--calib {self.calib}: not a regular file or folder (a device or "
                             "a pipe would be read without end): write the text to a file")
        if self.keep_fp8 and "awq" in self.method:
            raise ValueError("--keep-fp8 keeps the FP8 tensors byte for byte, and AWQ rescales the "
                             "non-target Linears it feeds (shared experts, dense MLPs): use "
                             "--method gptq or rtn with --keep-fp8")
        if self.mtp not in MTP_POLICIES:
            raise ValueError(f"--mtp must be one of {', '.join(MTP_POLICIES)}, got {self.mtp!r}")
        if self.scheme not in SCHEMES:
            raise ValueError(f"--scheme must be one of {', '.join(SCHEMES)}, got {self.scheme!r}")
        if self.scheme == "w4afp8" and (self.group_size != 128 or not self.symmetric):
            raise ValueError(
                f"--scheme w4afp8 needs --group-size 128 and symmetric weights (the CUTLASS W4A8 "
                f"MoE kernels of vLLM and SGLang take nothing else), got --group-size "
                f"{self.group_size}{' --asymmetric' if not self.symmetric else ''}")

    @classmethod
    def from_json(cls, options: dict) -> ConvertOptions:
        """The options a manifest records (`to_json`), read back: a key left out at its
        OMITTED_AT value is that value (not today's default for it), a routed-expert clip option
        left out follows the option it follows (ROUTED_OF)."""
        kw = {k: recorded_option(options, k) for k in (*OMITTED_AT, *ROUTED_OF)} | options
        return cls(**{**kw, "targets": frozenset(kw["targets"])})

    def to_json(self) -> dict:
        """The options as the manifest records them. `calib` by file name, not path (the
        manifest is published; the calibration tokens' sha256 pins the content for resume)."""
        d = asdict(self)
        d["targets"] = sorted(self.targets)
        for k, v in OMITTED_AT.items():  # (not recorded at these values: manifests stay as the
            if d[k] == v:  # versions before the field wrote them; a missing key reads back as v)
                del d[k]
        for k, follows in ROUTED_OF.items():  # (the same on every target: left out, as before;
            if getattr(self, k) == getattr(self, follows):  # recorded_option reads it back)
                del d[k]
        if "gptq" not in self.method:  # (off, not applicable: not recorded, as rtn_fallback;
            del d["sequential_mlp"]  # a gptq manifest records it, on or off)
        from quantize.source.hub import is_dataset_spec

        if d["calib"] is not None and not is_dataset_spec(d["calib"]):  # a Hub id is no path
            d["calib"] = Path(d["calib"]).name
        return d
