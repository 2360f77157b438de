// The engine's contract types: its enums (Status, Tier, MissReason, StepKind), StepResult, and the
// checks both engines share (a state's restore check, the disk tier's digests). A file of its own:
// the native and the reference engine answer in these.

#include "bindings.h"

#include "llama_shard/hot_kv_engine.h"
#include "llama_shard/kv_file_store.h"
#include "llama_shard/kv_state_check.h"

#include <string>

namespace llama_shard::bindings {

// the engine's enums and StepResult, shared by the native and reference engines
void register_contract_types(py::module_ & m) {
    m.def(
        "kv_state_problem",
        [](py::bytes state, int32_t seq_len, bool values) {
            const std::string blob = state;
            const auto * data = (const uint8_t *) blob.data();
            std::string why;
            const bool ok = values ? kv_state_values_ok(data, blob.size(), seq_len, why)
                                   : kv_state_positions_ok(data, blob.size(), seq_len, why);
            return ok ? std::string() : why;
        },
        py::arg("state"), py::arg("seq_len"), py::arg("values") = false,
        "What the restore check (kv_state_check.h) finds wrong with a llama.cpp sequence state of seq_len tokens "
        "(with values: every K/V value finite too); '' if nothing.");
    m.def("warm_sha256", &kv_file_store::sha256_implementation,
          "Whose SHA-256 the warm files' MAC uses: 'openssl' (libcrypto, when the build found it) or 'vendored'.");
    m.def("model_digest", &kv_file_store::model_digest, py::call_guard<py::gil_scoped_release>(), py::arg("path"),
          "The model identity the disk tier writes into its files: the file's size and XXH3-128 of all of it (one read of the file)");

    py::enum_<shard_status>(m, "Status", "What the engine answered for a request")
        .value("OK", SHARD_STATUS_OK)
        .value("CACHE_MISS", SHARD_STATUS_CACHE_MISS)
        .value("STALE_EPOCH", SHARD_STATUS_STALE_EPOCH)
        .value("BUDGET_EXCEEDED", SHARD_STATUS_BUDGET_EXCEEDED)
        .value("INVALID_INPUT", SHARD_STATUS_INVALID_INPUT)
        .value("COMPUTE_ERROR", SHARD_STATUS_COMPUTE_ERROR)
        .value("BUSY", SHARD_STATUS_BUSY);

    py::enum_<hot_kv_tier>(m, "Tier", "Where a session's KV is: HOT (in the llama_context), WARM (host memory) or NONE")
        .value("NONE", HOT_KV_TIER_NONE)
        .value("HOT", HOT_KV_TIER_HOT)
        .value("WARM", HOT_KV_TIER_WARM)
        .value("DISK", HOT_KV_TIER_DISK);

    py::enum_<shard_miss_reason>(m, "MissReason", "Why a request could not be served from cache")
        .value("NONE", SHARD_MISS_NONE)
        .value("UNKNOWN_SESSION", SHARD_MISS_UNKNOWN_SESSION)
        .value("EVICTED_TTL", SHARD_MISS_EVICTED_TTL)
        .value("EVICTED_LRU", SHARD_MISS_EVICTED_LRU)
        .value("RELEASED", SHARD_MISS_RELEASED)
        .value("SUPERSEDED_EPOCH", SHARD_MISS_SUPERSEDED_EPOCH)
        .value("SEQ_LEN_MISMATCH", SHARD_MISS_SEQ_LEN_MISMATCH)
        .value("PREFIX_EVICTED", SHARD_MISS_PREFIX_EVICTED);

    py::enum_<hot_kv_step_kind>(m, "StepKind", "A step appends a prompt chunk (PREFILL) or decode token(s) (DECODE)")
        .value("PREFILL", HOT_KV_STEP_PREFILL)
        .value("DECODE", HOT_KV_STEP_DECODE);

    py::class_<hot_kv_result>(m, "StepResult")
        .def_readonly("status", &hot_kv_result::status)
        .def_readonly("miss", &hot_kv_result::miss)
        .def_readonly("seq_len", &hot_kv_result::seq_len)
        .def_readonly("seq_id", &hot_kv_result::seq_id)
        .def_readonly("current_epoch", &hot_kv_result::current_epoch)
        .def_readonly("changed", &hot_kv_result::changed)
        .def_readonly("tier", &hot_kv_result::tier)
        .def_readonly("detail", &hot_kv_result::detail)
        .def("__repr__", [](const hot_kv_result & r) {
            return std::string("StepResult(") + shard_status_name(r.status) + ", miss=" + shard_miss_reason_name(r.miss) +
                   ", seq_len=" + std::to_string(r.seq_len) + ")";
        });
}

} // namespace llama_shard::bindings
