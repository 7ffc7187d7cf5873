"""Linear layers that load Hugging Face weights: replicated, merged, and tensor-parallel.

Parameters are created uninitialized; `weight_loader(param, loaded, shard_id)` always takes the
FULL HF tensor (or one full HF shard of a merged layer) and copies this rank's part. TP rank/size
come from `mla_backend.distributed` at build time; parallel layers' inputs/outputs are this rank's.

| class                      | weight on rank r          | forward                                |
|----------------------------|---------------------------|----------------------------------------|
| ReplicatedLinear           | [out, in] (all of it)     | x W^T + b                              |
| MergedLinear, QKVLinear    | [sum(sizes), in]          | several HF projections in one matmul   |
| ColumnParallelLinear       | [out/tp, in] rows of r    | local out features (gather optional)   |
| MergedColumnParallelLinear | each shard's rows of r    | [shard0_r | shard1_r | ...]            |
| QKVParallelLinear          | r's q heads, r's kv heads | [q_r | k_r | v_r]                      |
| RowParallelLinear          | [out, in/tp] cols of r    | x_r W_r^T, all-reduced, + b            |

Column-parallel (no gather) into row-parallel costs one all-reduce (Megatron); at TP size 1 each
parallel class equals its replicated counterpart. `quant_method` (`layers.quantization`) is
`UnquantizedLinearMethod`, `Fp8LinearMethod` (per-tensor FP8) or `BlockFP8LinearMethod`
(DeepSeek-V3 block FP8); scales load row-expanded, so the weight's slicing rules apply to them.
"""

from __future__ import annotations

import torch
from torch import nn

from mla_backend.distributed import (
    divide,
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)


from mla_backend.layers.quantization import (
    BlockFP8Config, PerTokenFp8, QuantConfig, _make_weight, _rows)


class ReplicatedLinear(nn.Module):
    """y = x W^T (+ b). weight [out_features, in_features] (HF layout), bias [out_features].

    Args of forward: x [..., in_features]. Returns [..., out_features], dtype of x.
    quant_config: None (weight in the model dtype) or a `BlockFP8Config` (fp8 weight +
    `weight_scale_inv`, see `BlockFP8LinearMethod`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        _make_weight(self, out_features, in_features, quant_config)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, x_fp8: PerTokenFp8 | None = None) -> torch.Tensor:
        """x_fp8: optional x quantized per token (used by dynamic FP8 weights only)."""
        return self.quant_method.apply(self, x, self.bias, x_fp8)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy a whole HF tensor into `param`. Raises ValueError on a shape mismatch."""
        loaded = _rows(param, loaded, self.out_features)
        if param.shape != loaded.shape:
            raise ValueError(f"shape mismatch: param {tuple(param.shape)} vs {tuple(loaded.shape)}")
        param.data.copy_(loaded)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


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
        quant_config: QuantConfig | None = None,
    ) -> None:
        super().__init__(in_features, sum(output_sizes), bias, quant_config)
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
        loaded = _rows(param, loaded, size)
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


# ------------------------------------------------------------------ tensor-parallel layers
def resolve_tp(tp_rank: int | None, tp_size: int | None) -> tuple[int, int]:
    """(rank, size) for a TP layer: the given overrides, else the process-wide TP group.

    Raises:
        ValueError: size < 1 or rank outside [0, size).
    """
    size = get_tp_size() if tp_size is None else tp_size
    rank = get_tp_rank() if tp_rank is None else tp_rank
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"invalid tensor parallel rank {rank} of size {size}")
    return rank, size


def _check_full(what: str, loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != expected:
        raise ValueError(f"{what}: expected the full HF tensor of shape {expected}, "
                         f"got {tuple(loaded.shape)}")


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with the output features split across TP ranks.

    Args:
        in_features, out_features: full (HF) sizes; tp_size must divide out_features.
        bias: whether there is a bias (split like the rows).
        gather_output: all-gather the output so every rank gets all out_features (otherwise each
            rank keeps its [out_features/tp] part, e.g. to feed a RowParallelLinear).
        tp_rank, tp_size: overrides of the TP group's rank/size (for sharding only: the forward's
            collectives always use the process-wide group).
        quant_config: None or a `BlockFP8Config` (see `BlockFP8LinearMethod`; the scales are
            split with the rows).

    Parameters: weight [out_features/tp, in_features] = HF rows [r*out/tp, (r+1)*out/tp) of rank r;
    bias [out_features/tp]. Forward: x [..., in_features] -> [..., out_features/tp] (or
    [..., out_features] with gather_output), dtype of x.

    Raises:
        ValueError: tp_size does not divide out_features.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 gather_output: bool = False, *, tp_rank: int | None = None,
                 tp_size: int | None = None,
                 quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = resolve_tp(tp_rank, tp_size)
        self.in_features = in_features
        self.out_features = out_features
        self.out_features_per_rank = divide(out_features, self.tp_size, "out_features")
        self.gather_output = gather_output
        _make_weight(self, self.out_features_per_rank, in_features, quant_config)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features_per_rank), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, x_fp8: PerTokenFp8 | None = None) -> torch.Tensor:
        """x_fp8: optional x quantized per token (used by dynamic FP8 weights only)."""
        y = self.quant_method.apply(self, x, self.bias, x_fp8)
        if self.gather_output and self.tp_size > 1:
            y = tensor_model_parallel_all_gather(y, dim=-1)
        return y

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's rows of the full HF tensor `loaded` ([out_features, in_features] for
        the weight, [out_features] for the bias) into `param`. `shard_id` is ignored.

        Raises:
            ValueError: `loaded` is not the full tensor's shape.
        """
        loaded = _rows(param, loaded, self.out_features)
        _check_full("ColumnParallelLinear", loaded, (self.out_features, *param.shape[1:]))
        n = self.out_features_per_rank
        param.data.copy_(loaded.narrow(0, self.tp_rank * n, n))

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features_per_rank} "
                f"(of {self.out_features}, tp {self.tp_rank}/{self.tp_size}), "
                f"bias={self.bias is not None}, gather_output={self.gather_output}")


class _MergedColumnBase(ColumnParallelLinear):
    """Column-parallel layer made of named shards, each split across ranks on its own.

    Subclasses call `_set_shards` with, per shard: name, full (HF) rows, local rows, and the
    first full row this rank holds.
    """

    def _set_shards(self, names: tuple, full_sizes: list[int], local_sizes: list[int],
                    src_starts: list[int]) -> None:
        if len(names) != len(full_sizes):
            raise ValueError("shard_names and output_sizes differ in length")
        self.full_output_sizes = list(full_sizes)
        self.output_sizes = list(local_sizes)
        self.shard_offsets: dict = {}  # name -> (local row offset, local rows)
        self._shard_src: dict = {}  # name -> (first full row held, full rows, full row offset)
        local, full = 0, 0
        for name, fsize, lsize, src in zip(names, full_sizes, local_sizes, src_starts):
            self.shard_offsets[name] = (local, lsize)
            self._shard_src[name] = (src, fsize, full)
            local += lsize
            full += fsize

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's part of HF shard `shard_id` (the full shard tensor, [full rows, in]
        or [full rows] for a bias) into its rows of `param`. shard_id None: `loaded` is all
        shards stacked in order (a fused checkpoint tensor), each is loaded in turn.

        Raises:
            KeyError: unknown shard_id. ValueError: `loaded` is not the full shard's shape.
        """
        rest = tuple(param.shape[1:])
        if shard_id is None:
            loaded = _rows(param, loaded, sum(self.full_output_sizes))
            _check_full(type(self).__name__, loaded, (sum(self.full_output_sizes), *rest))
            for name, (_, fsize, foff) in self._shard_src.items():
                self._load_shard(param, loaded.narrow(0, foff, fsize), name)
            return
        if shard_id in self._shard_src:
            loaded = _rows(param, loaded, self._shard_src[shard_id][1])
        self._load_shard(param, loaded, shard_id)

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        rest = tuple(param.shape[1:])
        if shard_id not in self.shard_offsets:
            raise KeyError(f"{type(self).__name__}: unknown shard {shard_id!r} "
                           f"(known: {list(self.shard_offsets)})")
        start, size = self.shard_offsets[shard_id]
        src, fsize, _ = self._shard_src[shard_id]
        _check_full(f"{type(self).__name__} shard {shard_id!r}", loaded, (fsize, *rest))
        param.data.narrow(0, start, size).copy_(loaded.narrow(0, src, size))


class MergedColumnParallelLinear(_MergedColumnBase):
    """Several HF projections of the same input in one column-parallel matmul (e.g. gate/up).

    Args:
        in_features: input size.
        output_sizes: full (HF) output size of each shard; tp_size must divide each.
        bias: whether each shard has a bias.
        shard_names: one name per shard (e.g. ("gate", "up")); default 0, 1, ...
        tp_rank, tp_size: overrides of the TP group's rank/size (see ColumnParallelLinear).
        quant_config: None or a `BlockFP8Config` (each shard's scales load with its rows).

    Rank r's weight is [sum(size_i/tp), in_features]: shard i's rows [r*size_i/tp,
    (r+1)*size_i/tp) at local offset sum(size_j/tp, j < i), so the output is
    [..., shard0_r | shard1_r | ...] (what SiluAndMul expects for gate/up). Attributes:
    `output_sizes` and `shard_offsets` ({name: (local start, local rows)}) are per rank;
    `full_output_sizes` are the HF sizes.

    Raises:
        ValueError: tp_size does not divide a shard size; shard_names of the wrong length.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 shard_names: tuple | None = None, *, tp_rank: int | None = None,
                 tp_size: int | None = None,
                 quant_config: QuantConfig | None = None) -> None:
        rank, size = resolve_tp(tp_rank, tp_size)
        names = tuple(range(len(output_sizes))) if shard_names is None else tuple(shard_names)
        local = [divide(s, size, f"output size of shard {n!r}")
                 for n, s in zip(names, output_sizes)]
        super().__init__(in_features, sum(output_sizes), bias, tp_rank=rank, tp_size=size,
                         quant_config=quant_config)
        self._set_shards(names, list(output_sizes), local, [rank * n for n in local])


class QKVParallelLinear(_MergedColumnBase):
    """q, k, v projections in one column-parallel matmul, split by heads.

    Args:
        hidden_size: input size.
        head_dim: size of one head.
        num_heads, num_kv_heads: full (HF) head counts.
        bias: whether q/k/v have biases.
        tp_rank, tp_size: overrides of the TP group's rank/size (see ColumnParallelLinear).

    Rank r holds q heads [r*H/tp, (r+1)*H/tp). KV heads are split the same way when
    num_kv_heads >= tp; otherwise each rank holds one KV head, `r * num_kv_heads // tp`
    (replicated on tp/num_kv_heads ranks), which is the head its q heads attend to under GQA.
    Output [..., q_r (num_heads*head_dim) | k_r (kv_size) | v_r (kv_size)]; shard ids "q", "k",
    "v" take the FULL HF q_proj/k_proj/v_proj tensors (weight or bias).

    Attributes (per rank): `num_heads`, `num_kv_heads`, `q_size`, `kv_size` (features),
    `output_sizes`, `shard_offsets`; full: `total_num_heads`, `total_num_kv_heads`;
    `num_kv_head_replicas` ranks hold each KV head.

    Raises:
        ValueError: tp does not divide num_heads; or num_kv_heads >= tp and tp does not divide
            it; or num_kv_heads < tp and num_kv_heads does not divide tp.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, *, tp_rank: int | None = None,
                 tp_size: int | None = None, quant_config: QuantConfig | None = None) -> None:
        rank, tp = resolve_tp(tp_rank, tp_size)
        if num_heads % tp != 0:
            raise ValueError(f"tensor parallel size {tp} does not divide num_heads={num_heads} "
                             "(attention heads are split across ranks)")
        if num_kv_heads >= tp:
            if num_kv_heads % tp != 0:
                raise ValueError(
                    f"tensor parallel size {tp} does not divide num_kv_heads={num_kv_heads} "
                    "(KV heads are split across ranks when there are at least as many as ranks)")
            local_kv, first_kv, replicas = num_kv_heads // tp, rank * (num_kv_heads // tp), 1
        else:
            if tp % num_kv_heads != 0:
                raise ValueError(
                    f"num_kv_heads={num_kv_heads} does not divide tensor parallel size {tp} "
                    "(with fewer KV heads than ranks each KV head is replicated on tp/num_kv_heads "
                    "ranks)")
            local_kv, first_kv, replicas = 1, rank * num_kv_heads // tp, tp // num_kv_heads
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads, self.num_kv_heads = num_heads // tp, local_kv
        self.num_kv_head_replicas = replicas
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, local_kv * head_dim
        full_q, full_kv = num_heads * head_dim, num_kv_heads * head_dim
        local_out = self.q_size + 2 * self.kv_size
        # The base sizes the weight from out_features / tp: give it the local rows * tp.
        super().__init__(hidden_size, local_out * tp, bias, tp_rank=rank, tp_size=tp,
                         quant_config=quant_config)
        self.out_features = full_q + 2 * full_kv
        kv_src = first_kv * head_dim
        self._set_shards(("q", "k", "v"), [full_q, full_kv, full_kv],
                         [self.q_size, self.kv_size, self.kv_size],
                         [rank * self.q_size, kv_src, kv_src])


class RowParallelLinear(nn.Module):
    """y = x W^T (+ b) with the input features split across TP ranks.

    Args:
        in_features, out_features: full (HF) sizes; tp_size must divide in_features.
        bias: whether there is a bias (held whole on every rank, added once).
        reduce_results: all-reduce the partial products (then add the bias). False leaves the
            reduction to the caller (e.g. an MoE that sums shared and routed parts first): the
            bias is then added by rank 0 only, so the caller's sum counts it once.
        tp_rank, tp_size: overrides of the TP group's rank/size (see ColumnParallelLinear).
        quant_config: None or a `BlockFP8Config` (with tp > 1, in_features/tp must be a multiple
            of the K block, so activation groups and weight blocks stay aligned).

    Parameters: weight [out_features, in_features/tp] = HF columns [r*in/tp, (r+1)*in/tp) of rank
    r; bias [out_features]. Forward: x [..., in_features/tp] (this rank's part, e.g. the output
    of a ColumnParallelLinear) -> [..., out_features], dtype of x; the full sum on every rank
    when reduce_results.

    Raises:
        ValueError: tp_size does not divide in_features; see quant_config.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 reduce_results: bool = True, *, tp_rank: int | None = None,
                 tp_size: int | None = None,
                 quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = resolve_tp(tp_rank, tp_size)
        self.in_features = in_features
        self.out_features = out_features
        self.in_features_per_rank = divide(in_features, self.tp_size, "in_features")
        self.reduce_results = reduce_results
        if (isinstance(quant_config, BlockFP8Config) and self.tp_size > 1
                and self.in_features_per_rank % quant_config.weight_block_size[1]):
            raise ValueError(
                f"block-FP8 RowParallelLinear: in_features per rank {self.in_features_per_rank} "
                f"is not a multiple of the K block {quant_config.weight_block_size[1]}")
        _make_weight(self, out_features, self.in_features_per_rank, quant_config)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, x_fp8: PerTokenFp8 | None = None) -> torch.Tensor:
        """x_fp8: optional x (this rank's columns) quantized per token (used by dynamic FP8
        weights only)."""
        apply = self.quant_method.apply
        if self.tp_size == 1:
            return apply(self, x, self.bias, x_fp8)
        if not self.reduce_results:
            return apply(self, x, self.bias if self.tp_rank == 0 else None, x_fp8)
        y = tensor_model_parallel_all_reduce(apply(self, x, None, x_fp8))
        if self.bias is not None:
            y.add_(self.bias)  # once, after the sum
        return y

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's columns of the full HF weight [out_features, in_features], or the
        whole HF bias [out_features], into `param`. `shard_id` is ignored.

        Raises:
            ValueError: `loaded` is not the full tensor's shape.
        """
        if param.dim() == 1:  # bias (or a per-tensor FP8 scale, row-expanded): whole on every rank
            loaded = _rows(param, loaded, self.out_features)
            _check_full("RowParallelLinear bias", loaded, (self.out_features,))
            param.data.copy_(loaded)
            return
        if getattr(param, "block_scale_rows", None) is not None:  # scale: K blocks of rank r
            bk = self.quant_method.block_k
            loaded = _rows(param, loaded, self.out_features)
            _check_full("RowParallelLinear weight_scale_inv", loaded,
                        (self.out_features, -(-self.in_features // bk)))
            kb = param.shape[1]
            param.data.copy_(loaded.narrow(1, self.tp_rank * self.in_features_per_rank // bk, kb))
            return
        _check_full("RowParallelLinear", loaded, (self.out_features, self.in_features))
        n = self.in_features_per_rank
        param.data.copy_(loaded.narrow(1, self.tp_rank * n, n))

    def extra_repr(self) -> str:
        return (f"in={self.in_features_per_rank} (of {self.in_features}, "
                f"tp {self.tp_rank}/{self.tp_size}), out={self.out_features}, "
                f"bias={self.bias is not None}, reduce_results={self.reduce_results}")


# TP-aware short names (column = split outputs, row = split inputs).
ColumnLinear = ColumnParallelLinear
RowLinear = RowParallelLinear
