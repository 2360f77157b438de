// KV element types and what one cached token costs: the one formula, below the model and the
// context (the model reports its bytes per token, the context sizes its cache with it, and Python's
// memory plan and the reference call it through the bindings).
#pragma once

#include "ggml.h"

#include <cstdint>
#include <string>
#include <vector>

namespace llama_shard {

// the KV element types a context may use: f16, q8_0, q4_0 (the quantized ones run flash attention)
const std::vector<std::string> & shard_kv_types();

// ggml's type for one of those names; throws shard_error(SHARD_ERRC_INVALID_ARGUMENT) for another
ggml_type kv_ggml_type(const std::string & kv_type);

// K and V bytes one cached token takes over n_layers layers (ggml's row sizes); throws
// shard_error(SHARD_ERRC_INVALID_ARGUMENT) for another type name or a head size it cannot quantize
uint64_t kv_bytes_per_token(int32_t n_head_kv, int32_t head_dim, int32_t n_layers, const std::string & kv_type);

}  // namespace llama_shard
