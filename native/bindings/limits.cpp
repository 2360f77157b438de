// The limits and defaults Python reads from the engine (hot_kv_limits.h, step_loop.h,
// prefix_store.h, recurrent_checkpoints.h) and the KV types: constants, no class. A file of its
// own so every number Python takes from here is in one place.

#include "bindings.h"

#include "llama_shard/hot_kv_engine.h"
#include "llama_shard/kv_type.h"
#include "llama_shard/recurrent_checkpoints.h"
#include "llama_shard/step_loop.h"

#include <limits>

namespace llama_shard::bindings {

// the limits and defaults Python reads from here (hot_kv_limits.h, step_loop.h, prefix_store.h), the KV types
void register_limits(py::module_ & m) {
    m.attr("MAX_SESSIONS")         = SHARD_MAX_SEQUENCES;
    // a hybrid session's recurrent-state checkpoints at most (recurrent_checkpoints.h): the memory plan's
    m.attr("CHECKPOINTS_PER_SESSION") = recurrent_checkpoints::MAX_CHECKPOINTS;
    m.attr("CHECKPOINT_INPUT_ROWS")   = recurrent_checkpoints::MAX_INPUT_ROWS;
    m.attr("MAX_SESSION_ID_BYTES") = HOT_KV_MAX_SESSION_ID_BYTES;
    m.attr("MAX_CONTEXT_TOKENS")   = HOT_KV_MAX_CONTEXT_TOKENS;
    m.attr("MAX_LOGIT_ROWS")       = HOT_KV_MAX_LOGIT_ROWS;
    m.attr("MAX_BUDGET_TOKENS")    = HOT_KV_MAX_BUDGET_TOKENS;
    m.attr("MAX_EPOCH")            = HOT_KV_MAX_EPOCH;
    // the defaults, from the structs that hold them (Python's defaults are these values)
    m.attr("DEFAULT_PREFILL_CHUNK")    = step_loop_config{}.prefill_chunk;
    m.attr("DEFAULT_GATHER_S")         = step_loop_config{}.gather_s;
    // upper bounds (seconds) of the restore-time histogram buckets, the last +Inf
    py::list buckets;
    for (double b : HOT_KV_RESTORE_BUCKETS) {
        buckets.append(b);
    }
    buckets.append(std::numeric_limits<double>::infinity());
    m.attr("RESTORE_BUCKETS") = py::tuple(buckets);
    m.attr("PREFIX_HIT_SECONDS") = HOT_KV_PREFIX_HIT_SECONDS;  // the prefix store's eviction weight (prefix_store.h)
    m.attr("PREFIX_HIT_CAP")     = HOT_KV_PREFIX_HIT_CAP;
    m.def("kv_types", &shard_kv_types, "The KV element types a context may use (llama.cpp's type_k/type_v).");
    m.def("kv_bytes_per_token",
          py::overload_cast<int32_t, int32_t, int32_t, const std::string &>(&llama_shard::kv_bytes_per_token),
          py::arg("n_head_kv"), py::arg("head_dim"), py::arg("n_layers"), py::arg("kv_type") = "f16",
          "K and V bytes one cached token takes over n_layers layers (ggml's row sizes).");
}

} // namespace llama_shard::bindings
