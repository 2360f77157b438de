#include "llama_shard/kv_type.h"
#include "llama_shard/shard_error.h"

namespace llama_shard {

const std::vector<std::string> & shard_kv_types() {
    static const std::vector<std::string> names{"f16", "q8_0", "q4_0"};  // in the order of kv_ggml_type's
    return names;
}

ggml_type kv_ggml_type(const std::string & name) {
    static const ggml_type types[] = {GGML_TYPE_F16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0};
    const auto & names = shard_kv_types();
    for (size_t i = 0; i < names.size(); ++i) {
        if (names[i] == name) {
            return types[i];
        }
    }
    throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "kv_type must be f16, q8_0 or q4_0, got '" + name + "'");
}

uint64_t kv_bytes_per_token(int32_t n_head_kv, int32_t head_dim, int32_t n_layers, const std::string & kv_type) {
    const ggml_type type = kv_ggml_type(kv_type);
    if (n_head_kv < 1 || head_dim < 1 || n_layers < 0) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "n_head_kv and head_dim must be >= 1 and n_layers >= 0");
    }
    if (head_dim % ggml_blck_size(type) != 0) {  // llama.cpp quantizes each head's row in blocks
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "kv_type " + kv_type + " needs a head size that is a multiple of " +
                          std::to_string(ggml_blck_size(type)) + "; this model's is " + std::to_string(head_dim));
    }
    // one K row and one V row per layer
    return 2ull * (uint64_t) ggml_row_size(type, (int64_t) n_head_kv * head_dim) * (uint64_t) n_layers;
}

}  // namespace llama_shard
