#pragma once

// json_schema_grammar: a JSON Schema turned into GBNF for the grammar sampler, by the pinned
// llama.cpp's own converter (common/json-schema-to-grammar.cpp, compiled from the pinned source:
// the one llama-server uses for response_format).
//
// Invariants: the schema is JSON text of at most SCHEMA_MAX_BYTES, nested at most
// SCHEMA_MAX_DEPTH deep (the converter recurses per level); every failure of the parser or the
// converter is shard_error(SHARD_ERRC_INVALID_ARGUMENT) with its reason, never an abort.

#include <cstddef>
#include <string>

namespace llama_shard {

constexpr size_t SCHEMA_MAX_BYTES = 64 * 1024;
constexpr int    SCHEMA_MAX_DEPTH = 64;

// GBNF whose start rule is `root`, accepting exactly the JSON texts the schema describes (as far as
// llama.cpp's converter supports the schema's keywords)
std::string json_schema_to_gbnf(const std::string & schema_json);

} // namespace llama_shard
