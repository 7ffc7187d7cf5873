"""Engine configuration: one frozen `EngineConfig` built once, never mutated.

Owns the names, types, defaults and validation of every engine setting. Data comes from the
`parameters` block of a model's config.pbtxt (all values are strings there) through
`EngineConfig.from_parameters`, or from keyword arguments in tests and benchmarks through
`EngineConfig.create`. Each component receives only its sub-config.

Errors: `ConfigError` (a `ValueError`) naming the offending key, for unknown keys, values that do
not parse as the key's type, and values out of range.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping


ATTENTION_BACKENDS = ("auto", "triton", "torch_native", "flashinfer")
KV_CACHE_DTYPE_NAMES = ("auto", "fp8_e4m3", "fp8_e5m2")
QUANTIZATION_NAMES = ("", "fp8")  # = layers.quantization.QUANTIZATION_METHODS

# The cycle collector's generation thresholds while serving (Python's default: 700, 10, 10),
# set by `engine.freeze_startup_objects` and the tensor-parallel workers. A decode step
# allocates a few tracked containers per request (outputs, token lists), so with the default a
# large batch runs several young collections per step and a peak run spends seconds in the
# collector (issue 6). The engine makes few reference cycles; their garbage waits longer.
GC_THRESHOLDS = (20_000, 50, 50)


class ConfigError(ValueError):
    """A setting is unknown, malformed or out of range; the message names the setting."""


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to load and how to run its math.

    Filled by: `EngineConfig.from_parameters` / `EngineConfig.create`.
    """

    model_path: str = ""  # local HF folder: config.json, *.safetensors, tokenizer files
    dtype: str = "auto"  # "auto" (fp32 on CPU, bf16 on GPU), "float32", "bfloat16", "float16"
    device: str = "auto"  # "auto" (cuda when available), "cpu", "cuda", "cuda:N"
    # Cap on tokens per request (prompt + output); None = the checkpoint's max_position_embeddings.
    context_length: int | None = None
    # DeepSeek MLA: store decompressed per-head K/V in the MHA pool instead of the latent.
    disable_mla: bool = False
    # DeepSeek MLA: an extend batch with no cached prefix and at least this many new tokens runs the
    # decompressed (normal MHA) prefill; every other batch runs the absorbed path.
    mla_decompress_min_tokens: int = 64
    # "auto": read the safetensors in model_path; "dummy": random weights of the right shapes
    # (config.json only; for benchmarks with real shapes and no checkpoint, as vLLM/SGLang).
    load_format: str = "auto"
    # Linear-layer weights: "" = as the checkpoint (unquantized, or its own FP8 format);
    # "fp8" = online per-tensor FP8 of an unquantized checkpoint (vLLM's `--quantization fp8`;
    # see layers.quantization.Fp8Config). An FP8 checkpoint is always run in its own format.
    quantization: str = ""


@dataclass(frozen=True)
class CacheConfig:
    """KV pools and the prefix cache."""

    enable_radix_cache: bool = True
    # Token slots in the KV pool; None = derived (CPU: 16384; GPU: from free memory).
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.88  # GPU only: fraction of total memory for weights + pools
    # KV pool storage: "auto" (the model dtype), "fp8_e4m3" or "fp8_e5m2" (1 byte per value;
    # per-layer scales from the checkpoint's `self_attn.k_scale` / `v_scale` / `kv_scale`,
    # else 1.0).
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits and policy (SGLang v0.3 names and defaults)."""

    schedule_policy: str = "lpm"  # "lpm" (longest prefix match) or "fcfs"
    chunked_prefill_size: int = 8192  # tokens per prefill chunk; <= 0 disables chunking
    max_prefill_tokens: int = 16384  # new tokens admitted per extend batch
    max_running_requests: int | None = None  # None = derived from pool sizes
    schedule_conservativeness: float = 1.0
    # While requests decode, a new prefill starts only once at least this many request rows
    # are free (or every waiting request fits the free rows, or the queue has waited
    # `scheduler.PREFILL_MAX_DELAY_STEPS` decode steps): fewer, larger prefill batches under
    # saturation. 1 = admit as soon as one row is free (SGLang v0.3's behaviour).
    prefill_min_free_rows: int = 1
    # Overlap the host's per-token work (detokenization, stop strings, streamed outputs) of
    # step N with the GPU's forward of step N + 1 (`Engine.step`): "auto" = on for CUDA devices,
    # "true", "false". On: every output leaves one step later; a request stopped by a stop
    # string runs one extra (discarded) decode step.
    overlap_schedule: str = "auto"
    # Jump-forward for structured outputs: when a request's grammar allows exactly one token at
    # each of the next >= this many steps, those tokens are appended without a decode step each
    # and computed in one EXTEND step (the forced tokens at the start of an output join the
    # prompt's prefill). 0 = off (the default: finding the forced rows costs host time every
    # step, docs/benchmarks.md).
    jump_forward_min_tokens: int = 0


@dataclass(frozen=True)
class ParallelConfig:
    # Ranks the model is split over. > 1: rank 0's ModelRunner spawns the other ranks
    # (`model_executor.tp_workers`), unless the caller already initialized the process group.
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class RunnerConfig:
    # "auto" (triton on CUDA, torch_native on CPU), "triton", "torch_native", "flashinfer"
    # (optional: flashinfer-python installed by the user; CUDA, bf16 / fp16, no CUDA graphs)
    attention_backend: str = "auto"
    seed: int = 0  # seeds weight-independent randomness (sampling without a per-request seed)
    # CUDA graphs for decode (GPU + triton backend only): batch-size buckets 1, 2, 4, 8, then
    # steps of 8 up to cuda_graph_max_bs (capped at max_running_requests).
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 160
    # torch.compile(mode="max-autotune-no-cudagraphs") of the decode forward for graph buckets
    # <= torch_compile_max_bs (needs CUDA graphs).
    enable_torch_compile: bool = False
    torch_compile_max_bs: int = 32
    torch_compile_mode: str = "max-autotune-no-cudagraphs"  # torch.compile's mode argument
    # Prefill warm-up at load (`Engine.warm_up`): "auto" (on CUDA), "true", "false".
    warmup: str = "auto"
    # A prefill / extend batch of few new tokens run as one decode row per token, through the
    # decode CUDA graphs (`Engine._extend_as_decode`): "auto" (default: when a graph fits the
    # batch), "true" (also eagerly, without graphs: tests), "false".
    extend_as_decode: str = "auto"


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(cls, **settings: Any) -> "EngineConfig":
        """Build from flat keyword settings (names as in config.pbtxt), typed values allowed.

        Raises:
            ConfigError: unknown key, wrong type or out-of-range value.
        """
        groups: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        for key, value in settings.items():
            section = _KEY_TO_SECTION.get(key)
            if section is None:
                raise ConfigError(
                    f"unknown engine setting {key!r}; known settings: {', '.join(sorted(_KEY_TO_SECTION))}"
                )
            groups[section][key] = _coerce(key, value, _KEY_TYPES[key])
        cfg = cls(**{name: _SECTIONS[name](**vals) for name, vals in groups.items()})
        cfg.validate()
        return cfg

    @classmethod
    def from_parameters(
        cls, parameters: Mapping[str, Any], base_dir: str | None = None, ignore: tuple[str, ...] = ()
    ) -> "EngineConfig":
        """Build from a config.pbtxt `parameters` map.

        Args:
            parameters: Triton's model_config["parameters"]: {key: {"string_value": "..."}} or
                plain {key: value}.
            base_dir: folder that a relative `model_path` is resolved against (the model's folder).
            ignore: keys that belong to the adapter, not the engine.
        Raises:
            ConfigError: as `create`.
        """
        flat: dict[str, Any] = {}
        for key, value in parameters.items():
            if key in ignore:
                continue
            if isinstance(value, Mapping):
                value = value.get("string_value", "")
            flat[key] = value
        path = flat.get("model_path")
        if isinstance(path, str) and path and base_dir and not os.path.isabs(path):
            flat["model_path"] = os.path.normpath(os.path.join(base_dir, path))
        return cls.create(**flat)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raises ConfigError on the first invalid setting."""
        m, c, s, p, r = self.model, self.cache, self.scheduler, self.parallel, self.runner
        if not m.model_path:
            raise ConfigError("model_path is required (a local Hugging Face model folder)")
        _check(m.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
               f"must be auto, float32, bfloat16 or float16, got {m.dtype!r}")
        _check(m.device == "auto" or m.device == "cpu" or m.device.startswith("cuda"), "device",
               f"must be auto, cpu or cuda[:N], got {m.device!r}")
        _check(m.context_length is None or m.context_length >= 2, "context_length",
               f"must be >= 2, got {m.context_length}")
        _check(m.mla_decompress_min_tokens >= 0, "mla_decompress_min_tokens", "must be >= 0")
        _check(m.load_format in ("auto", "dummy"), "load_format",
               f"must be auto or dummy, got {m.load_format!r}")
        _check(m.quantization in QUANTIZATION_NAMES, "quantization",
               f"must be one of {QUANTIZATION_NAMES} ('' = none), got {m.quantization!r}")
        _check(c.max_total_tokens is None or c.max_total_tokens >= 2, "max_total_tokens",
               f"must be >= 2, got {c.max_total_tokens}")
        _check(0.0 < c.mem_fraction_static < 1.0, "mem_fraction_static", "must be in (0, 1)")
        _check(c.kv_cache_dtype in KV_CACHE_DTYPE_NAMES, "kv_cache_dtype",
               f"must be one of {', '.join(KV_CACHE_DTYPE_NAMES)}, got {c.kv_cache_dtype!r}")
        _check(s.schedule_policy in ("lpm", "fcfs"), "schedule_policy",
               f"must be lpm or fcfs, got {s.schedule_policy!r}")
        _check(s.max_prefill_tokens >= 1, "max_prefill_tokens", "must be >= 1")
        _check(s.prefill_min_free_rows >= 1, "prefill_min_free_rows", "must be >= 1")
        _check(s.jump_forward_min_tokens >= 0, "jump_forward_min_tokens", "must be >= 0")
        _check(s.overlap_schedule in ("auto", "true", "false"), "overlap_schedule",
               f"must be auto, true or false, got {s.overlap_schedule!r}")
        _check(s.max_running_requests is None or s.max_running_requests >= 1,
               "max_running_requests", "must be >= 1")
        _check(s.schedule_conservativeness > 0, "schedule_conservativeness", "must be > 0")
        _check(p.tensor_parallel_size >= 1, "tensor_parallel_size",
               f"must be >= 1, got {p.tensor_parallel_size}")
        _check(r.cuda_graph_max_bs >= 1, "cuda_graph_max_bs", "must be >= 1")
        _check(r.torch_compile_max_bs >= 1, "torch_compile_max_bs", "must be >= 1")
        _check(r.torch_compile_mode in ("default", "reduce-overhead", "max-autotune",
                                        "max-autotune-no-cudagraphs"), "torch_compile_mode",
               f"not a torch.compile mode: {r.torch_compile_mode!r}")
        _check(not (r.enable_torch_compile and r.disable_cuda_graph), "enable_torch_compile",
               "needs CUDA graphs (disable_cuda_graph is true)")
        _check(r.warmup in ("auto", "true", "false"), "warmup",
               f"must be auto, true or false, got {r.warmup!r}")
        _check(r.extend_as_decode in ("auto", "true", "false"), "extend_as_decode",
               f"must be auto, true or false, got {r.extend_as_decode!r}")
        _check(r.attention_backend in ATTENTION_BACKENDS, "attention_backend",
               f"must be one of {', '.join(ATTENTION_BACKENDS)}, got {r.attention_backend!r}")

    def replace(self, **settings: Any) -> "EngineConfig":
        """A new validated config with some flat settings changed (self is unchanged)."""
        flat = {f.name: getattr(getattr(self, sec), f.name)
                for sec, typ in _SECTIONS.items() for f in fields(typ)}
        flat.update(settings)
        return EngineConfig.create(**flat)


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "runner": RunnerConfig,
}
_KEY_TO_SECTION = {f.name: sec for sec, typ in _SECTIONS.items() for f in fields(typ)}
_KEY_TYPES = {f.name: f.type for typ in _SECTIONS.values() for f in fields(typ)}


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _coerce(key: str, value: Any, type_name: str) -> Any:
    """Coerce a setting (often a string from config.pbtxt) to its declared type."""
    optional = "None" in type_name
    base = type_name.replace("| None", "").strip()
    if optional and (value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null"))):
        return None
    try:
        if base == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"):
                return True
            if isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off"):
                return False
            if isinstance(value, int) and value in (0, 1):
                return bool(value)
            raise ValueError
        if base == "int":
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value.strip()) if isinstance(value, str) else int(value)
        if base == "float":
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if base == "str":
            if not isinstance(value, str):
                raise ValueError
            return value.strip()
    except (TypeError, ValueError):
        pass
    raise ConfigError(f"{key}: expected {base}, got {value!r}")


__all__ = [
    "CacheConfig",
    "ConfigError",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "RunnerConfig",
    "SchedulerConfig",
]
