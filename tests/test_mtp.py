"""The MTP layer's policy (issue 13, item 3): `--mtp int4` (default) rounds its experts like
every decoder layer's, `--mtp keep` keeps them as in the source (BF16), and the `ignore` list
says so under every name the engines give the draft: the checkpoint's (`model.layers.N.*`),
vLLM's (`model.layers.N.mtp_block.*`) and SGLang's NextN module (`model.decoder.*`, with
`model.eh_proj` / `model.shared_head`); verify names a missing MTP tensor as such."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from quantize.check.verify import verify
from quantize.options import ConvertOptions
from quantize.pipeline import convert
from quantize.plan import make_plan
from quantize.source.checkpoint import open_checkpoint
from quantize.source.layout import is_ignored


def _names(mtp: int) -> dict[str, list[str]]:
    """The MTP layer's modules as the checkpoint, vLLM and SGLang spell them."""
    return {
        "experts": [f"model.layers.{mtp}.mlp.experts.0.gate_proj", f"model.layers.{mtp}.mlp.experts.3.down_proj",
                    f"model.layers.{mtp}.mtp_block.mlp.experts.0.gate_proj",  # vLLM
                    f"model.layers.{mtp}.mtp_block.mlp.experts",  # vLLM's fused FusedMoE
                    "model.decoder.mlp.experts.0.gate_proj", "model.decoder.mlp.experts"],  # SGLang
        "never": [f"model.layers.{mtp}.eh_proj", "model.eh_proj", "model.shared_head.head",
                  f"model.layers.{mtp}.shared_head.head", "model.decoder.self_attn.q_a_proj",
                  "model.decoder.self_attn.fused_qkv_a_proj", "model.decoder.mlp.gate",
                  f"model.layers.{mtp}.mtp_block.self_attn.o_proj"],
    }


@pytest.mark.parametrize("policy", ["int4", "keep"])
def test_ignore_matches_the_mtp_layer_under_every_engine_name(dsa_fp8, policy):
    ckpt = open_checkpoint(dsa_fp8)
    mtp = ckpt.num_hidden_layers
    plan = make_plan(ckpt, ConvertOptions(mtp=policy))
    names = _names(mtp)
    for n in names["never"]:  # never INT4, under either policy
        assert is_ignored(n, list(plan.ignore)), n
    for n in names["experts"]:
        assert is_ignored(n, list(plan.ignore)) == (policy == "keep"), (policy, n)
    for n in ("model.layers.1.mlp.experts.0.gate_proj", "model.layers.1.mlp.experts"):
        assert not is_ignored(n, list(plan.ignore))  # the decoder layers' experts stay targets
    mtp_units = [u for u in plan.units if u.source.startswith(f"model.layers.{mtp}.mlp.experts.")]
    assert mtp_units and all(u.action == ("quantize" if policy == "int4" else "dequant") for u in mtp_units)


def test_mtp_keep_writes_bf16_mtp_experts_and_verifies(dsa_fp8, tmp_path):
    ckpt = open_checkpoint(dsa_fp8)
    mtp = ckpt.num_hidden_layers
    out = tmp_path / "keep"
    convert(dsa_fp8, out, ConvertOptions(mtp="keep"), device="cpu", tp=1)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    w = f"model.layers.{mtp}.mlp.experts.0.gate_proj.weight"
    assert w in index and f"model.layers.{mtp}.mlp.experts.0.gate_proj.weight_packed" not in index
    assert "model.layers.1.mlp.experts.0.gate_proj.weight_packed" in index
    with safe_open(out / index[w], "pt") as f:
        assert str(f.get_tensor(w).dtype) == "torch.bfloat16"
    src_mtp = {n for n in ckpt.tensors if n.startswith(f"model.layers.{mtp}.")
               and not n.endswith("weight_scale_inv")}
    assert src_mtp <= set(index)  # every MTP tensor listed
    assert verify(dsa_fp8, out).ok
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert rf"re:model\.layers\.({mtp})\..*" in qc["ignore"] and r"re:model\.decoder\..*" in qc["ignore"]

    # an index that leaves out the shard holding MTP tensors (as a converter bug would, the
    # manifest agreeing): verify says what that does to the draft
    from quantize.write.shards import sha256_file

    ip = out / "model.safetensors.index.json"
    idx = json.loads(ip.read_text())
    shard = idx["weight_map"][w]
    idx["weight_map"] = {n: f for n, f in idx["weight_map"].items() if f != shard}
    ip.write_text(json.dumps(idx))
    mp = out / "quantize-manifest.json"
    m = json.loads(mp.read_text())
    m["files"][ip.name] = {"bytes": ip.stat().st_size, "sha256": sha256_file(ip)}
    mp.write_text(json.dumps(m))
    rep = verify(dsa_fp8, out, write=False)
    assert not rep.ok and any(w in p and "MTP-layer tensor" in p for p in rep.problems)
