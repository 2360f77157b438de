// HotKvEngine: the Hot KV engine (hot_kv_engine.h), its memory plan, and its counters as the dict
// HotKvStateManager.stats() documents. A file of its own: one bound class per file; the class is
// bound in parts (a session's calls, its transfers, its upkeep), each a function of its own.

#include "bindings.h"

#include "llama_shard/hot_kv_engine.h"

#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace llama_shard::bindings {

namespace {

using engine_class = py::class_<hot_kv_engine>;

py::dict memory_dict(const shard_memory & mem) {
    return to_dict({{"device", mem.device},
                    {"device_free", mem.device_free},
                    {"device_total", mem.device_total},
                    {"device_model", mem.device_model},
                    {"device_context", mem.device_context},
                    {"device_compute", mem.device_compute},
                    {"host_model", mem.host_model},
                    {"host_context", mem.host_context},
                    {"host_compute", mem.host_compute}});
}

// the engine's counters as a dict (the keys HotKvStateManager.stats() documents)
py::dict stats_dict(const hot_kv_stats & st) {
    py::dict misses;
    for (int r = SHARD_MISS_UNKNOWN_SESSION; r < SHARD_MISS_COUNT; ++r) {
        misses[shard_miss_reason_name((shard_miss_reason) r)] = st.misses[(size_t) r];
    }
    py::list buckets;  // (upper bound, restores in that bucket); the last bound is +Inf
    for (size_t i = 0; i < st.restore_buckets.size(); ++i) {
        const double le = i < HOT_KV_RESTORE_BUCKETS.size() ? HOT_KV_RESTORE_BUCKETS[i]
                                                              : std::numeric_limits<double>::infinity();
        buckets.append(py::make_tuple(le, st.restore_buckets[i]));
    }
    return to_dict({{"live_sessions", st.live_sessions},
                    {"max_sessions", st.max_sessions},
                    {"reserved_tokens", st.reserved_tokens},
                    {"budget_tokens", st.budget_tokens},
                    {"context_tokens", st.context_tokens},
                    {"kv_bytes_per_token", st.kv_bytes_per_token},
                    {"reserved_bytes", st.reserved_bytes},
                    {"evictions_ttl", st.evictions_ttl},
                    {"evictions_lru", st.evictions_lru},
                    {"releases", st.releases},
                    {"supersessions", st.supersessions},
                    {"steps", st.steps},
                    {"tokens_computed", st.tokens_computed},
                    {"recent_keys", st.recent_keys},
                    {"misses", misses},
                    {"spills", st.spills},
                    {"restores", st.restores},
                    {"checkpoints_taken", st.checkpoints_taken},
                    {"checkpoint_restores", st.checkpoint_restores},
                    {"checkpoint_tokens", st.checkpoint_tokens},
                    {"checkpoint_bytes", st.checkpoint_bytes},
                    {"warm_drops", st.warm_drops},
                    {"warm_sessions", st.warm_sessions},
                    {"warm_bytes", st.warm_bytes},
                    {"warm_capacity", st.warm_capacity},
                    {"restore_seconds", st.restore_seconds},
                    {"restore_buckets", buckets},
                    {"disk_sessions", st.disk_sessions},
                    {"disk_bytes", st.disk_bytes},
                    {"disk_capacity", st.disk_capacity},
                    {"disk_spills", st.disk_spills},
                    {"disk_restores", st.disk_restores},
                    {"disk_loaded", st.disk_loaded},
                    {"disk_failures", st.disk_failures},
                    {"prefix_entries", st.prefix_entries},
                    {"prefix_bytes", st.prefix_bytes},
                    {"prefix_capacity", st.prefix_capacity},
                    {"prefix_stores", st.prefix_stores},
                    {"prefix_hits", st.prefix_hits},
                    {"prefix_tokens_saved", st.prefix_tokens_saved},
                    {"prefix_evictions", st.prefix_evictions}});
}

// a session's calls (open, truncate, release, resolve) and the context's counters read between them
void register_engine_sessions(engine_class & cls) {
    cls
        .def("open", [](hot_kv_engine & e, const std::string & sid, int64_t epoch, double now) {
                 py::gil_scoped_release release;  // waits for the engine lock, held for a whole step
                 return e.open(sid, epoch, now);
             }, py::arg("session_id"), py::arg("epoch"), py::arg("now"))
        .def_property_readonly("n_decode_calls", [](const hot_kv_engine & e) {
                 py::gil_scoped_release release;  // waits for the context mutex, held for a whole step
                 return e.n_decode_calls();
             })
        .def_property_readonly("whole_rows_verdicts", [](const hot_kv_engine & e) {
                 std::map<int32_t, std::string> out;
                 {
                     py::gil_scoped_release release;  // waits for the context mutex, held for a whole step
                     out = e.whole_rows_verdicts();
                 }
                 return out;
             },
             "How a verification's rows (row_by_row) are computed, by row count, once the first of that "
             "count was computed in one llama_decode call and row by row and compared: 'one call' (the "
             "same bytes, in less time), 'row by row: one call was slower', 'row by row: one call rounded "
             "differently'. {} until one is tried, and always where attention is not patch 0010's kernel "
             "on the CPU")
        .def("truncate", [](hot_kv_engine & e, const std::string & sid, int64_t epoch, int32_t length, double now) {
                 py::gil_scoped_release release;  // waits for the engine lock; may restore a warm session
                 return e.truncate(sid, epoch, length, now);
             }, py::arg("session_id"), py::arg("epoch"), py::arg("length"), py::arg("now"))
        .def("release", [](hot_kv_engine & e, const std::string & sid, int64_t epoch, double now) {
                 py::gil_scoped_release release;  // waits for the engine lock, held for a whole step
                 return e.release(sid, epoch, now);
             }, py::arg("session_id"), py::arg("epoch"), py::arg("now"))
        .def("resolve", [](hot_kv_engine & e, const std::string & sid, int64_t epoch, double now) {
                 py::gil_scoped_release release;  // waits for the engine lock, held for a whole step
                 return e.resolve(sid, epoch, now);
             }, py::arg("session_id"), py::arg("epoch"), py::arg("now"));
}

// state that moves: into and out of the prefix store, and a session handed to another worker
void register_engine_transfers(engine_class & cls) {
    cls
        .def("store_prefix", [](hot_kv_engine & e, const std::string & sid, int64_t epoch, uint64_t key, int32_t length,
                                double now) {
                 py::gil_scoped_release release;  // waits for the engine lock; copies the session's state
                 return e.store_prefix(sid, epoch, key, length, now);
             }, py::arg("session_id"), py::arg("epoch"), py::arg("key"), py::arg("length"), py::arg("now"),
             "Copies the hot session's first `length` tokens (all it holds) into the prefix store under `key`")
        .def("open_prefix", [](hot_kv_engine & e, const std::string & sid, int64_t epoch, uint64_t key, int32_t length,
                               double now) {
                 py::gil_scoped_release release;  // waits for the engine lock; restores the prefix's state
                 return e.open_prefix(sid, epoch, key, length, now);
             }, py::arg("session_id"), py::arg("epoch"), py::arg("key"), py::arg("length"), py::arg("now"),
             "Makes the session hold a copy of the stored prefix (a PREFIX_EVICTED miss when it is not stored)")
        .def("export_session", [](hot_kv_engine & e, const std::string & sid, int64_t epoch, double now) {
                 page_buffer state;
                 hot_kv_result r;
                 {
                     py::gil_scoped_release release;  // waits for the engine lock; copies the session's state
                     r = e.export_session(sid, epoch, now, state);
                 }
                 return py::make_tuple(r, py::bytes(reinterpret_cast<const char *>(state.data()), state.size()));
             }, py::arg("session_id"), py::arg("epoch"), py::arg("now"),
             "(result, llama.cpp's sequence state of the session's owned layers): the session stays where it is")
        .def("import_session", [](hot_kv_engine & e, const std::string & sid, int64_t epoch, int32_t seq_len,
                                  const py::bytes & state, double now) {
                 char * data = nullptr;
                 Py_ssize_t size = 0;
                 if (PyBytes_AsStringAndSize(state.ptr(), &data, &size) != 0) {
                     throw py::error_already_set();
                 }
                 // bytes are immutable and `state` holds a reference for this frame: read without the GIL
                 py::gil_scoped_release release;  // waits for the engine lock; restores the state
                 return e.import_session(sid, epoch, seq_len, reinterpret_cast<const uint8_t *>(data), (size_t) size, now);
             }, py::arg("session_id"), py::arg("epoch"), py::arg("seq_len"), py::arg("state"), py::arg("now"),
             "Makes the session hold exactly `state` (an export of seq_len tokens of this shard) as a hot session")
        .def("prefix_length", [](const hot_kv_engine & e, uint64_t key) {
                 py::gil_scoped_release release;  // waits for the engine lock
                 return e.prefix_length(key);
             }, py::arg("key"), "The length of the prefix stored under `key`, 0 when none");
}

// upkeep and what the engine reports: the disk tier at shutdown, the TTL sweep, the invariants,
// the sessions and the counters
void register_engine_upkeep(engine_class & cls) {
    cls
        .def("persist", [](hot_kv_engine & e, double now) {
                 py::gil_scoped_release release;  // writes files
                 return e.persist(now);
             }, py::arg("now"), "Writes every hot and warm session to the disk tier; returns the sessions on disk")
        .def("sweep", [](hot_kv_engine & e, double now) {
                 py::gil_scoped_release release;  // waits for the engine lock, held for a whole step
                 return e.sweep(now);
             }, py::arg("now"))
        .def("check_invariants", [](const hot_kv_engine & e) {
                 py::gil_scoped_release release;  // waits for the engine lock, held for a whole step
                 e.check_invariants();
             })
        .def("sessions", [](const hot_kv_engine & e) {
                 std::vector<hot_kv_session_info> live;
                 {
                     py::gil_scoped_release release;  // a short lock of its own (a published snapshot)
                     live = e.sessions();
                 }
                 py::list out;
                 for (const auto & s : live) {
                     out.append(py::make_tuple(s.session_id, s.epoch, s.seq_id, s.seq_len, s.last_used, s.tier));
                 }
                 return out;
             })
        .def("stats", [](const hot_kv_engine & e) {
                 hot_kv_stats st;
                 {
                     py::gil_scoped_release release;  // a short lock of its own (a published snapshot)
                     st = e.stats();
                 }
                 return stats_dict(st);
             });
}

} // namespace

// HotKvEngine and its memory plan
void register_engine(py::module_ & m) {
    m.def("plan_memory", [](const std::string & path, std::optional<std::pair<int32_t, int32_t>> layers,
                            const std::string & device, int32_t gpu_layers, const hot_kv_config & config,
                            int32_t cpu_moe_layers) {
              shard_model_params mp;
              mp.path = path;
              mp.layers = layers;
              mp.n_threads = 1;
              mp.device = device;
              mp.gpu_layers = gpu_layers;
              mp.cpu_moe_layers = cpu_moe_layers;
              shard_memory mem;
              {
                  py::gil_scoped_release release;  // reads the GGUF's metadata
                  mem = hot_kv_plan_memory(mp, config);
              }
              return memory_dict(mem);
          },
          py::arg("path"), py::arg("layers"), py::arg("device"), py::arg("gpu_layers"), py::arg("config"),
          py::arg("cpu_moe_layers") = 0,
          "A dry run of a shard and the engine `config` makes over it (nothing allocated, no weight read): the "
          "bytes llama.cpp would hold on the device and the host, as HotKvEngine.memory() reports them loaded.");
    engine_class cls(m, "HotKvEngine");
    cls
        .def("memory", [](const hot_kv_engine & self) {
                 shard_memory mem;
                 {
                     py::gil_scoped_release release;  // waits for the context mutex
                     mem = self.memory();
                 }
                 return memory_dict(mem);
             }, "What the engine's context and model hold, by llama.cpp's account: device, device_free, "
                "device_total, device_model/context/compute (weights, KV, compute buffers) and host_*.")
        .def(py::init([](const shard_model & model, const hot_kv_config & config) {
                 py::gil_scoped_release release;  // allocating the KV cache (and scanning the disk tier); only C++ objects are touched
                 return std::make_unique<hot_kv_engine>(model, config);
             }),
             py::arg("model"), py::arg("config"), py::keep_alive<1, 2>())
        .def_property_readonly("config", [](const hot_kv_engine & e) { return e.config(); },
             "A copy of the engine's configuration (n_batch as the context granted it)")
        .def_property_readonly("kv_type", [](const hot_kv_engine & e) { return e.config().kv_type; })
        .def_property_readonly("flash_attn", [](const hot_kv_engine & e) { return e.config().flash_attn; })
        .def_property_readonly("n_batch", [](const hot_kv_engine & e) { return e.config().n_batch; });
    register_engine_sessions(cls);
    register_engine_transfers(cls);
    register_engine_upkeep(cls);
}

} // namespace llama_shard::bindings
