// HotKvConfig: the engine's one configuration (hot_kv_config), bound field by field with the
// struct's defaults. A file of its own: one bound class per file.

#include "bindings.h"

#include "llama_shard/hot_kv_engine.h"

#include <string>

namespace llama_shard::bindings {

// HotKvConfig: the engine's one configuration (hot_kv_config), its defaults the struct's
void register_config(py::module_ & m) {
    const hot_kv_config d;
    py::class_<hot_kv_config>(m, "HotKvConfig",
        "The Hot KV engine's configuration (hot_kv_config): the defaults are the native struct's, check() the one "
        "check of its bounds; both engines take it")
        .def(py::init([](int32_t max_sessions, int32_t context_tokens, int64_t budget_tokens, double ttl_seconds,
                         int32_t n_batch, int32_t n_threads, int32_t recent_capacity, int64_t warm_bytes,
                         double warm_ttl_seconds, std::string kv_type, bool flash_attn, std::string warm_dir,
                         int64_t warm_disk_bytes, std::string recipe_fingerprint, int64_t prefix_bytes) {
                 return hot_kv_config{max_sessions, context_tokens, budget_tokens, ttl_seconds, n_batch, n_threads,
                                      recent_capacity, warm_bytes, warm_ttl_seconds, std::move(kv_type), flash_attn,
                                      std::move(warm_dir), warm_disk_bytes, std::move(recipe_fingerprint), prefix_bytes};
             }),
             py::kw_only(), py::arg("max_sessions") = d.max_sessions, py::arg("context_tokens") = d.context_tokens,
             py::arg("budget_tokens") = d.budget_tokens, py::arg("ttl_seconds") = d.ttl_seconds,
             py::arg("n_batch") = d.n_batch, py::arg("n_threads") = d.n_threads,
             py::arg("recent_capacity") = d.recent_capacity, py::arg("warm_bytes") = d.warm_bytes,
             py::arg("warm_ttl_seconds") = d.warm_ttl_seconds, py::arg("kv_type") = d.kv_type,
             py::arg("flash_attn") = d.flash_attn, py::arg("warm_dir") = d.warm_dir, py::arg("warm_disk_bytes") = d.warm_disk_bytes,
             py::arg("recipe_fingerprint") = d.recipe_fingerprint, py::arg("prefix_bytes") = d.prefix_bytes)
        .def_readwrite("max_sessions", &hot_kv_config::max_sessions)
        .def_readwrite("context_tokens", &hot_kv_config::context_tokens)
        .def_readwrite("budget_tokens", &hot_kv_config::budget_tokens)
        .def_readwrite("ttl_seconds", &hot_kv_config::ttl_seconds)
        .def_readwrite("n_batch", &hot_kv_config::n_batch)
        .def_readwrite("n_threads", &hot_kv_config::n_threads)
        .def_readwrite("recent_capacity", &hot_kv_config::recent_capacity)
        .def_readwrite("warm_bytes", &hot_kv_config::warm_bytes)
        .def_readwrite("warm_ttl_seconds", &hot_kv_config::warm_ttl_seconds)
        .def_readwrite("kv_type", &hot_kv_config::kv_type)
        .def_readwrite("flash_attn", &hot_kv_config::flash_attn)
        .def_readwrite("warm_dir", &hot_kv_config::warm_dir)
        .def_readwrite("warm_disk_bytes", &hot_kv_config::warm_disk_bytes)
        .def_readwrite("recipe_fingerprint", &hot_kv_config::recipe_fingerprint)
        .def_readwrite("prefix_bytes", &hot_kv_config::prefix_bytes)
        .def("check", &hot_kv_check_config, "InvalidInputError naming the first field outside its bounds")
        .def_property_readonly("slot_cells", [](const hot_kv_config & c) { return hot_kv_slot_cells(c.context_tokens, c.n_batch); },
             "Cells one hot slot allocates: max(context_tokens, n_batch) padded to 256, as llama_context does")
        .def("__repr__", [](const hot_kv_config & c) {
            return "HotKvConfig(max_sessions=" + std::to_string(c.max_sessions) + ", context_tokens=" +
                   std::to_string(c.context_tokens) + ", budget_tokens=" + std::to_string(c.budget_tokens) +
                   ", kv_type='" + c.kv_type + "', flash_attn=" + (c.flash_attn ? "True" : "False") + ", warm_bytes=" + std::to_string(c.warm_bytes) + ", warm_dir='" +
                   c.warm_dir + "', warm_disk_bytes=" + std::to_string(c.warm_disk_bytes) + ", prefix_bytes=" + std::to_string(c.prefix_bytes) + ", n_batch=" +
                   std::to_string(c.n_batch) + ")";
        });
}

} // namespace llama_shard::bindings
