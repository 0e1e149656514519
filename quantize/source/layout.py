"""What each tensor of a GLM checkpoint is, which Linears become INT4, and the `ignore` list.

Roles, decided by name (the release layouts in ../shared/reference/formats.md):

    routed    model.layers.L.mlp.experts.E.{gate,up,down}_proj      INT4 by default
    shared    model.layers.L.mlp.shared_experts.{gate,up,down}_proj  INT4 on request
    dense     model.layers.L.mlp.{gate,up,down}_proj (dense layers)  INT4 on request
    attention model.layers.L.self_attn.*  (MLA / GQA and the DSA indexer)
    router    model.layers.L.mlp.gate
    other     embeddings, lm_head, norms, MTP eh_proj / shared_head, biases

The engines match `ignore` against *their* module names, which fuse projections
(`gate_up_proj`, `fused_qkv_a_proj`, `qkv_proj`), so the regexes cover the fused names too:
`ignore_patterns` is checked against both spellings.
"""

from __future__ import annotations

import re

__all__ = [
    "ROLES",
    "fp8_targets",
    "fused_names",
    "ignore_patterns",
    "is_ignored",
    "layer_of",
    "linear_role",
    "module_of",
    "mtp_ignore",
    "natural_key",
]

ROLES = ("routed", "shared", "dense")

_ROUTED = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj$")
_SHARED = re.compile(r".*\.mlp\.shared_experts\.(gate|up|down)_proj$")
_DENSE = re.compile(r".*\.mlp\.(gate|up|down)_proj$")
_ATTN = re.compile(r".*\.self_attn\..*")
_ROUTER = re.compile(r".*\.mlp\.gate$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

# Always ignored: everything that is not an MLP projection.
_BASE_IGNORE = (
    "lm_head",
    r"re:.*embed_tokens.*",
    r"re:.*self_attn.*",
    r"re:.*mlp\.gate$",
    r"re:.*eh_proj.*",
    r"re:.*shared_head.*",
)
_IGNORE_SHARED = r"re:.*shared_experts.*"
# Routed experts left in BF16: one regex that also matches the engines' fused `...mlp.experts`
# module (per-expert exact names would be ~58k entries for GLM-5.2 and miss the fused name).
_IGNORE_ROUTED = r"re:.*mlp\.experts.*"
_IGNORE_DENSE = r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"


def module_of(weight_name: str) -> str:
    """`a.b.weight` -> `a.b`."""
    return weight_name.rsplit(".", 1)[0]


def layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def natural_key(name: str) -> tuple:
    """Sort key that puts layers.10 after layers.9 and expert 10 after expert 9."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def linear_role(module: str) -> str:
    """Role of a Linear module name (no `.weight` suffix)."""
    if _ROUTED.match(module):
        return "routed"
    if _SHARED.match(module):
        return "shared"
    if _DENSE.match(module):
        return "dense"
    if _ATTN.match(module):
        return "attention"
    if _ROUTER.match(module):
        return "router"
    return "other"


def mtp_ignore(layers: list[int]) -> list[str]:
    """`ignore` entries that keep the MTP layer(s) out of INT4 under every name an engine gives
    them: the checkpoint's and vLLM's (`model.layers.78.*`, vLLM's draft nests
    `model.layers.78.mtp_block.*`) and SGLang's NextN draft module (`model.decoder.*`, its
    `eh_proj` / `shared_head` under `model.*` are ignored by the base list already)."""
    if not layers:
        return []
    idx = "|".join(str(L) for L in sorted(layers))
    return [rf"re:model\.layers\.({idx})\..*", r"re:model\.decoder\..*"]


def fp8_targets(kept: list[str], num_hidden_layers: int) -> list[str]:
    """The FP8 group's targets for the Linears `--keep-fp8` keeps, as regexes that match them
    under every engine's names: a decoder-layer module by its path after `layers.N.` (e.g.
    `re:.*\\.self_attn\\.q_a_proj$`, also the draft's `model.decoder.self_attn.q_a_proj`) and
    its fused names (`fused_qkv_a_proj`, `gate_up_proj`, `qkv_proj`); routed experts of an MTP
    layer kept out of INT4 (`--mtp keep`) by the MTP regexes of `mtp_ignore`."""
    out: list[str] = []
    mtp: set[int] = set()
    for m in sorted(kept, key=natural_key):
        L = layer_of(m + ".")
        if L is not None and L >= num_hidden_layers and _ROUTED.match(m):
            mtp.add(L)
            continue
        for n in fused_names(m):
            tail = n.split(f"layers.{L}.", 1)[1] if L is not None else n
            rx = "re:.*\\." + re.escape(tail) + "$" if L is not None else n
            if L is not None and L >= num_hidden_layers and rx not in out:
                # an MTP layer's module that no decoder layer keeps (`--mtp keep` with that
                # role INT4 in the decoder layers): this layer's names only, as the draft
                # models name it, so the decoder layers' INT4 modules stay out of the group
                for r in (rf"re:model\.layers\.{L}\.(mtp_block\.)?{re.escape(tail)}$",
                          rf"re:model\.decoder\.{re.escape(tail)}$"):
                    if r not in out:
                        out.append(r)
                continue
            if rx not in out:
                out.append(rx)
    if mtp:
        idx = "|".join(str(L) for L in sorted(mtp))
        out += [rf"re:model\.layers\.({idx})\.(mtp_block\.)?mlp\.experts.*", r"re:model\.decoder\.mlp\.experts.*"]
    return out


# --keep-fp8: what stays ignored is what was BF16 in the release (routers, the DSA indexer's
# weights_proj, the MTP eh_proj / shared_head, embeddings, lm_head), under every engine's name
_KEEP_FP8_IGNORE = ("lm_head", r"re:.*embed_tokens.*", r"re:.*mlp\.gate$", r"re:.*eh_proj.*",
                    r"re:.*shared_head.*", r"re:.*indexer\.weights_proj$")


def ignore_patterns(targets: frozenset[str], other_linears: list[str],
                    keep_layers: list[int] = (), fp8_kept: list[str] = ()) -> list[str]:
    """The `ignore` list: fixed regexes for the roles left in BF16, the MTP layers kept out of
    INT4 (`keep_layers`, `mtp_ignore`), plus the exact name of any non-target Linear the regexes
    miss (so every Linear is a target or ignored). With `fp8_kept` (--keep-fp8: those are the
    FP8 group's targets, not ignored), only exact names: the BF16 Linears and lm_head."""
    if fp8_kept:
        pats = list(_KEEP_FP8_IGNORE)
        kept = set(fp8_kept)
        return pats + sorted({m for m in other_linears if m not in kept and not is_ignored(m, pats)},
                             key=natural_key)
    pats = list(_BASE_IGNORE) + mtp_ignore(list(keep_layers))
    if "routed" not in targets:
        pats.append(_IGNORE_ROUTED)
    if "shared" not in targets:
        pats.append(_IGNORE_SHARED)
    if "dense" not in targets:
        pats.append(_IGNORE_DENSE)
    pats += sorted({m for m in other_linears if not is_ignored(m, pats)}, key=natural_key)
    return pats


def is_ignored(module: str, patterns: list[str]) -> bool:
    """compressed-tensors / vLLM matching: `re:` entries are regexes (re.match), others exact
    names or a trailing component match."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], module):
                return True
        elif module == p or module.endswith("." + p):
            return True
    return False


def fused_names(module: str) -> list[str]:
    """The module name plus the names engines give it after fusing projections."""
    names = [module]
    for parts, fused in (
        (("gate_proj", "up_proj"), "gate_up_proj"),
        (("q_a_proj", "kv_a_proj_with_mqa"), "fused_qkv_a_proj"),
        (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    ):
        head, _, last = module.rpartition(".")
        if last in parts:
            names.append(f"{head}.{fused}" if head else fused)
    return names
