"""Reads checkpoint tensors from a local Hugging Face folder (single or sharded safetensors).

Data comes from `<model_path>/model.safetensors` or the shards listed in
`model.safetensors.index.json` (else every `*.safetensors` file, sorted); it goes to the model's
`load_weights` as (HF name, CPU tensor) pairs, one tensor in memory at a time.
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
