"""Linear layers that load Hugging Face weights, including merged projections.

No tensor parallelism yet (every layer holds the full matrix). Parameters are created
uninitialized (`torch.empty`): `load_weights` fills them, and loading checks that each was filled.

Merged layers keep one weight for several HF matrices (q/k/v → `qkv_proj`, gate/up →
`gate_up_proj`); `weight_loader(param, loaded, shard_id)` copies one HF matrix into its rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ReplicatedLinear(nn.Module):
    """y = x W^T (+ b). weight [out_features, in_features] (HF layout), bias [out_features].

    Args of forward: x [..., in_features]. Returns [..., out_features], dtype of x.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy a whole HF tensor into `param`. Raises ValueError on a shape mismatch."""
        if param.shape != loaded.shape:
            raise ValueError(f"shape mismatch: param {tuple(param.shape)} vs {tuple(loaded.shape)}")
        param.data.copy_(loaded)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


# Aliases with the TP-aware names, for when TP arrives (column = split outputs, row = split inputs).
ColumnLinear = ReplicatedLinear
RowLinear = ReplicatedLinear


class MergedLinear(ReplicatedLinear):
    """Several HF projections of the same input stacked along the output dim.

    Args:
        in_features: input size.
        output_sizes: output size of each shard, in order.
        shard_names: one name per shard (e.g. ("q", "k", "v")); default 0, 1, ...
        bias: whether each shard has a bias.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool = False,
        shard_names: tuple | None = None,
    ) -> None:
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        names = tuple(range(len(output_sizes))) if shard_names is None else tuple(shard_names)
        if len(names) != len(output_sizes):
            raise ValueError("shard_names and output_sizes differ in length")
        offsets, acc = {}, 0
        for name, size in zip(names, output_sizes):
            offsets[name] = (acc, size)
            acc += size
        self.shard_offsets = offsets

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy HF shard `shard_id` into its rows of `param` (weight or bias).

        Raises:
            KeyError: unknown shard_id. ValueError: shape mismatch.
        """
        if shard_id is None:
            return super().weight_loader(param, loaded)
        start, size = self.shard_offsets[shard_id]
        target = param.data.narrow(0, start, size)
        if target.shape != loaded.shape:
            raise ValueError(
                f"shard {shard_id!r}: param rows {tuple(target.shape)} vs {tuple(loaded.shape)}"
            )
        target.copy_(loaded)


class QKVLinear(MergedLinear):
    """q, k, v projections in one matmul.

    Output [q (H*d) | k (KV*d) | v (KV*d)]; shard ids "q", "k", "v".
    """

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias=bias, shard_names=("q", "k", "v"))
        self.q_size, self.kv_size = sizes[0], sizes[1]
