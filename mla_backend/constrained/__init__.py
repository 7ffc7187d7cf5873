"""Structured outputs (JSON schema, regex, choice, grammar) and token restrictions.

`spec` parses and validates the request fields (plain Python, importable at the serving edge);
`grammar` compiles specs with xgrammar and masks logits (imports torch and xgrammar: import it
where decoding happens, `from mla_backend.constrained.grammar import GrammarCompiler`).
"""

from .spec import (
    StructuredOutputSpec,
    parse_allowed_token_ids,
    parse_logit_bias,
    parse_structured_outputs,
    structured_outputs_from_sampling_parameters,
)

__all__ = [
    "StructuredOutputSpec",
    "parse_allowed_token_ids",
    "parse_logit_bias",
    "parse_structured_outputs",
    "structured_outputs_from_sampling_parameters",
]
