"""One GLM-5.2-shaped MoE decoder layer with random weights on a device, for the profiling
scripts (`profile_h200_layer.py`, `profile_routed_hessians.py`): no checkpoint, transformers'
own `glm_moe_dsa` class (hidden 6144, 256 experts of width 2048, top-8, MLA + DSA), layer 1 of
a two-layer model; `small`: the tiny test shapes (checks a script on a CPU).
"""
from __future__ import annotations

import torch

from quantize.calib.decoder import build_skeleton
from quantize.source.synth import GLM52_CONFIG, tiny_config


def random_moe_layer(small: bool, dev: torch.device, dt: torch.dtype, norm_std: float = 0.0
                     ) -> tuple[dict, object, torch.nn.Module, int]:
    """(config, skeleton, layer 1 in eval mode, the sample length): weights N(0, 0.02), norms
    1 (or N(1, norm_std)), the router in float32, float buffers zero; torch seeded 0 first."""
    cfg = {**tiny_config("glm_moe_dsa"), **({} if small else GLM52_CONFIG)}
    cfg.update(num_hidden_layers=2, first_k_dense_replace=1, num_nextn_predict_layers=0,
               vocab_size=4096, max_position_embeddings=4096)
    skeleton = build_skeleton(cfg)
    layer = skeleton.model.layers[1]
    layer.to(dt)
    layer.mlp.gate.float()
    layer.to_empty(device=dev)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in layer.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.02)
            elif norm_std:
                p.normal_(1.0, norm_std)
            else:
                p.fill_(1.0)
        for _, bf in layer.named_buffers():
            if bf.is_floating_point():
                bf.zero_()
    return cfg, skeleton, layer.eval(), 256 if small else 2048


def sync(dev: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
