"""Test helper: write a per-tensor FP8 copy (the vLLM / ModelOpt format) of an fp32 HF folder.

Every 2-D projection weight (`mla_tools.tiny_deepseek._is_fp8_linear`: not the
embedding, LM head or router) becomes `X.weight` float8_e4m3fn + `X.weight_scale` float32 scalar
(amax / 448 of that HF tensor, so q/k/v and gate/up shards get different scales), and config.json
gains `quantization_config` {"quant_method": "fp8", "activation_scheme": "dynamic"}; with
activation_scheme "static" also `X.input_scale` = STATIC_INPUT_SCALE for every such weight
(inputs up to 448 x 0.02 ~ 9 in magnitude stay unsaturated).
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from mla_backend.layers.quantization import quantize_fp8_per_tensor
from mla_tools.tiny_deepseek import _is_fp8_linear


STATIC_INPUT_SCALE = 0.02


def write_fp8_per_tensor_copy(src: str, dst: str, activation_scheme: str = "dynamic") -> str:
    """Copy the folder `src` to `dst` with per-tensor FP8 projection weights (and static input
    scales when activation_scheme is "static").

    Returns dst.
    """
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            continue
        out: dict[str, torch.Tensor] = {}
        for name, w in load_file(os.path.join(src, f)).items():
            if _is_fp8_linear(name, w):
                q, s = quantize_fp8_per_tensor(w)
                out[name] = q
                out[name[: -len("weight")] + "weight_scale"] = s.reshape(())
                if activation_scheme == "static":
                    out[name[: -len("weight")] + "input_scale"] = torch.tensor(
                        STATIC_INPUT_SCALE)
            else:
                out[name] = w
        save_file(out, os.path.join(dst, f), metadata={"format": "pt"})
    idx = os.path.join(dst, "model.safetensors.index.json")
    if os.path.exists(idx):  # add the scales to the shard index
        index = json.load(open(idx))
        wm = index["weight_map"]
        for name, shard in list(wm.items()):
            if name.endswith(".weight"):
                keys = load_file(os.path.join(dst, shard)).keys()
                for suffix in ("weight_scale", "input_scale"):
                    scale = name[: -len("weight")] + suffix
                    if scale in keys:
                        wm[scale] = shard
        json.dump(index, open(idx, "w"))
    cfg_path = os.path.join(dst, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": activation_scheme}
    json.dump(cfg, open(cfg_path, "w"), indent=2)
    return dst
