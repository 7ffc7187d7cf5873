"""Architecture name (config.json `architectures[0]`) → model class.

Model modules are imported by path on first use, so a missing or broken module fails only for
the architectures that need it.
"""

from __future__ import annotations

import importlib
from typing import Any

# architecture -> (module path, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("mla_backend.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("mla_backend.models.llama", "Qwen2ForCausalLM"),
    "MistralForCausalLM": ("mla_backend.models.llama", "MistralForCausalLM"),
    "DeepseekV2ForCausalLM": ("mla_backend.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("mla_backend.models.deepseek_v2", "DeepseekV3ForCausalLM"),
}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture has no implementation here."""


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architectures: list[str] | str | None) -> type:
    """The class for the first supported name in `architectures` (HF config field).

    Raises:
        UnsupportedModelError: none of the names is supported (message lists the supported ones).
        ImportError / AttributeError: the module of a supported architecture cannot be loaded.
    """
    names = [architectures] if isinstance(architectures, str) else list(architectures or [])
    for name in names:
        if name in _MODELS:
            module_path, cls_name = _MODELS[name]
            return getattr(importlib.import_module(module_path), cls_name)
    supported = ", ".join(supported_architectures())
    raise UnsupportedModelError(
        f"unsupported model architecture(s) {names}; supported: {supported}")


def get_model_class_for_config(hf_config: Any) -> type:
    """`get_model_class(hf_config.architectures)`."""
    return get_model_class(getattr(hf_config, "architectures", None))
