"""A JSON schema as a grammar: llama.cpp's own converter (common/json-schema-to-grammar.cpp, built
into the native module), its refusal an InvalidInputError."""

from __future__ import annotations

from .._native import json_schema_to_grammar


def grammar_from_schema(schema: str) -> str:
    """The GBNF grammar of a JSON schema's text; InvalidInputError says why there is none."""
    return json_schema_to_grammar(schema)
