"""Reads checkpoint tensors from a local Hugging Face folder (single or sharded safetensors),
or fills a model with random weights (`load_format="dummy"`).

Data comes from `<model_path>/model.safetensors` or the shards listed in
`model.safetensors.index.json` (else every `*.safetensors` file, sorted); it goes to the model's
`load_weights` as (HF name, CPU tensor) pairs, one tensor in memory at a time.
Dummy weights are made on the model's device (benchmarks with real shapes and no checkpoint).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open


def safetensors_files(model_path: str) -> list[str]:
    """Absolute paths of the weight files of `model_path`, in load order.

    Raises:
        FileNotFoundError: the folder is missing or holds no safetensors file, or the index
            names a shard that is not there.
    """
    if not os.path.isdir(model_path):
        raise FileNotFoundError(f"model folder {model_path!r} does not exist")
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_path, s) for s in shards]
        missing = [f for f in files if not os.path.exists(f)]
        if missing:
            raise FileNotFoundError(f"shards listed in {index} are missing: {missing}")
        return files
    single = os.path.join(model_path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    files = sorted(os.path.join(model_path, f) for f in os.listdir(model_path)
                   if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_path!r}")
    return files


def iterate_weights(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF tensor name, CPU tensor in its stored dtype) for every tensor of the folder."""
    for path in safetensors_files(model_path):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def init_dummy_weights(model: torch.nn.Module, seed: int = 0, scale: float = 0.02,
                       checkpoint_dtype: torch.dtype | None = None) -> None:
    """Fill every parameter in place: RMSNorm weights with 1, all others uniform in
    [-scale, scale] (seeded, on the parameter's device). Deterministic for a given seed and
    device. Buffers (rotary tables) are left as the constructors made them.

    checkpoint_dtype: the dtype a real checkpoint of this model stores (the model's 16-bit
    dtype); a wider floating parameter (the fp32 MoE router, `layers.moe.RouterGate`) then
    holds values of that dtype, as it would after loading such a checkpoint, so that what
    depends on the values (`RouterGate.prepare_16bit`) behaves as with real weights.
    """
    from mla_backend.layers.layernorm import RMSNorm

    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for p in model.parameters():
            if id(p) in norm_weights:
                p.fill_(1.0)
                continue
            gen = gens.get(p.device)
            if gen is None:
                gen = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            if p.dtype.is_floating_point:
                p.uniform_(-scale, scale, generator=gen)
                if (checkpoint_dtype is not None and checkpoint_dtype.is_floating_point
                        and p.dtype.itemsize > checkpoint_dtype.itemsize):
                    p.copy_(p.to(checkpoint_dtype))
