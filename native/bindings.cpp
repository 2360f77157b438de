// llama_shard._native: the only file that includes pybind11.
//
// Arrays cross without extra copies: hidden input is read in place (it must already be a
// C-contiguous float32 (n_tokens, n_embd) array; nothing is converted silently), outputs are
// allocated as numpy arrays and written by the engine directly. The GIL is released around every
// call that computes or loads. shard_error is translated to the classes of llama_shard.errors.

#include "llama_shard/cpu_backend.h"
#include "llama_shard/devices.h"
#include "llama_shard/hot_kv_engine.h"
#include "llama_shard/recurrent_checkpoints.h"
#include "llama_shard/json_schema_grammar.h"
#include "llama_shard/kv_state_check.h"
#include "llama_shard/shard_context.h"
#include "llama_shard/shard_model.h"
#include "llama_shard/step_loop.h"
#include "llama_shard/token_sampler.h"

#include "llama.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <fcntl.h>
#include <limits>

namespace py = pybind11;
using namespace llama_shard;

namespace {

const char * error_class_for(shard_errc code) {
    switch (code) {
        case SHARD_ERRC_INVALID_ARGUMENT:         return "InvalidInputError";
        case SHARD_ERRC_MODEL_LOAD:               return "ModelLoadError";
        case SHARD_ERRC_UNSUPPORTED_ARCHITECTURE: return "UncertifiedArchitectureError";
        case SHARD_ERRC_CAPACITY:                 return "CapacityError";
        case SHARD_ERRC_COMPUTE:                  return "ComputeError";
    }
    return "LlamaShardError";
}

// token ids from any 1-D integer sequence, range-checked before narrowing to int32
std::vector<int32_t> tokens_from_python(const py::object & obj, int32_t n_vocab) {
    py::array arr = py::array::ensure(obj);
    if (!arr) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "tokens must be a sequence of integers");
    }
    if (arr.ndim() != 1) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "tokens must be one-dimensional, got " + std::to_string(arr.ndim()) + " dimensions");
    }
    const char kind = arr.dtype().kind();
    if (arr.size() > 0 && kind != 'i' && kind != 'u') {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, std::string("tokens must be integers, got dtype kind '") + kind + "'");
    }
    std::vector<int32_t> out((size_t) arr.size());
    if (arr.size() == 0) {
        return out;
    }
    auto wide = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(arr);
    const int64_t * data = wide.data();
    for (py::ssize_t i = 0; i < wide.size(); ++i) {
        if (data[i] < 0 || data[i] >= n_vocab || (kind == 'u' && data[i] < 0)) {
            throw shard_error(SHARD_ERRC_INVALID_ARGUMENT,
                "token id " + std::to_string(data[i]) + " at index " + std::to_string(i) + " is outside the vocabulary [0, " +
                std::to_string(n_vocab) + ")");
        }
        out[(size_t) i] = (int32_t) data[i];
    }
    return out;
}

// a hidden-state array is used in place: it must already be float32, 2-D and C-contiguous
py::array_t<float> hidden_from_python(const py::object & obj, int32_t n_embd) {
    if (!py::isinstance<py::array>(obj)) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "hidden must be a numpy float32 array of shape (n_tokens, n_embd)");
    }
    py::array arr = py::reinterpret_borrow<py::array>(obj);
    if (!arr.dtype().is(py::dtype::of<float>())) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "hidden must have dtype float32, got " + std::string(py::str(arr.dtype())));
    }
    if (arr.ndim() != 2) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "hidden must be 2-D (n_tokens, n_embd), got " + std::to_string(arr.ndim()) + " dimensions");
    }
    if (arr.shape(1) != n_embd) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT,
            "hidden has " + std::to_string(arr.shape(1)) + " columns; this model's n_embd is " + std::to_string(n_embd));
    }
    if (!(arr.flags() & py::array::c_style)) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "hidden must be C-contiguous (use numpy.ascontiguousarray)");
    }
    return py::array_t<float>::ensure(arr);
}

// one step's input from Python, owning whatever the shard_input points at
struct py_input {
    shard_input          input;
    std::vector<int32_t> tokens;
    py::array_t<float>   hidden;
};

void parse_input(py_input & p, const shard_model_info & info, const py::object & tokens, const py::object & hidden) {
    if (!tokens.is_none() && !hidden.is_none()) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "pass exactly one of tokens or hidden, not both");
    }
    if (!tokens.is_none()) {
        p.tokens = tokens_from_python(tokens, info.n_vocab);
        if (p.tokens.empty()) {
            throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "empty input: at least one token is required");
        }
        p.input.tokens   = p.tokens.data();
        p.input.n_tokens = (int64_t) p.tokens.size();
    } else if (!hidden.is_none()) {
        p.hidden            = hidden_from_python(hidden, info.n_embd);
        p.input.hidden      = p.hidden.data();
        p.input.n_tokens    = p.hidden.shape(0);
        p.input.hidden_cols = p.hidden.shape(1);
    }
}

py::array_t<float> output_array(const shard_model_info & info, int64_t n_tokens) {
    return info.is_tail ? py::array_t<float>(std::vector<py::ssize_t>{info.n_vocab})
                        : py::array_t<float>(std::vector<py::ssize_t>{(py::ssize_t) n_tokens, info.n_embd});
}

// a step's size is checked before its output is allocated
void check_batch_size(const shard_input & input, int32_t n_batch) {
    if (input.n_tokens < 1 || input.n_tokens > n_batch) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "a step takes 1 to n_batch (" + std::to_string(n_batch) +
                          ") tokens, got " + std::to_string(input.n_tokens));
    }
}

// an optional int attribute of a Step: -1 for None
int32_t optional_position(const py::object & value, const char * name) {
    if (value.is_none()) {
        return -1;
    }
    const int64_t v = py::cast<int64_t>(value);
    if (v < 0 || v > std::numeric_limits<int32_t>::max()) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, std::string(name) + " must be in [0, 2^31), got " + std::to_string(v));
    }
    return (int32_t) v;
}

// a ticket for a llama_shard.Step (kind, session_id, route_epoch, token_ids, hidden, start_pos,
// expected_seq_len, logit_rows, row_by_row): validated, its input copied into the ticket (the loop thread never touches a
// Python object), not queued yet
std::shared_ptr<step_ticket> make_ticket(const step_loop & loop, const shard_model_info & info, const py::object & step,
                                         double now, int notify_fd) {
    auto t = std::make_shared<step_ticket>();
    try {
        t->kind       = py::cast<hot_kv_step_kind>(step.attr("kind"));
        t->session_id = py::cast<std::string>(step.attr("session_id"));
        t->epoch      = py::cast<int64_t>(step.attr("route_epoch"));
        t->position   = t->kind == HOT_KV_STEP_PREFILL ? optional_position(step.attr("start_pos"), "start_pos")
                                                       : optional_position(step.attr("expected_seq_len"), "expected_seq_len");
        py_input p;
        parse_input(p, info, step.attr("token_ids"), step.attr("hidden"));
        if (p.input.n_tokens < 1) {
            throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "a step needs token ids (head) or hidden rows (other shards)");
        }
        t->n_tokens = p.input.n_tokens;
        t->n_logits = py::cast<int32_t>(step.attr("logit_rows"));
        t->row_by_row = py::cast<bool>(step.attr("row_by_row"));
        if (p.input.tokens != nullptr) {
            t->tokens = std::move(p.tokens);
        } else {
            t->hidden.assign(p.input.hidden, p.input.hidden + p.input.n_tokens * info.n_embd);
            // every row is checked now: a chunked prefill must not find a bad row after its first chunk
            if (!std::all_of(t->hidden.begin(), t->hidden.end(), [](float v) { return std::isfinite(v); })) {
                throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "hidden contains a non-finite value");
            }
        }
    } catch (const py::cast_error & e) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, std::string("malformed step: ") + e.what());
    } catch (const py::error_already_set & e) {  // a missing attribute, an int that does not fit
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, std::string("malformed step: ") + e.what());
    }
    if (notify_fd >= 0) {  // the step thread writes to it: it must never block
        const int flags = fcntl(notify_fd, F_GETFL);
        if (flags < 0 || !(flags & O_NONBLOCK)) {
            throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "notify_fd must be an open, non-blocking file descriptor");
        }
    }
    t->now       = now;
    t->notify_fd = notify_fd;
    t->out_cols  = info.is_tail ? 0 : info.n_embd;
    loop.check_ticket(*t);
    return t;
}

// the ticket's output as a numpy array over the ticket's own buffer (no copy; the array keeps the
// ticket alive), or None unless the step completed OK
py::object ticket_output(const std::shared_ptr<step_ticket> & t, const py::object & self) {
    if (!t->done() || t->result().status != SHARD_STATUS_OK) {
        return py::none();
    }
    const auto f = (py::ssize_t) sizeof(float);
    if (t->out_cols == 0) {
        return py::array_t<float>({(py::ssize_t) t->out.size()}, {f}, t->out.data(), self);
    }
    const auto cols = (py::ssize_t) t->out_cols;
    return py::array_t<float>({(py::ssize_t) t->out.size() / cols, cols}, {cols * f, f}, t->out.data(), self);
}


// the engine's counters as a dict (the keys HotKvStateManager.stats() documents)
py::dict stats_dict(const hot_kv_stats & st) {
    py::dict misses;
    for (int r = SHARD_MISS_UNKNOWN_SESSION; r < SHARD_MISS_COUNT; ++r) {
        misses[shard_miss_reason_name((shard_miss_reason) r)] = st.misses[(size_t) r];
    }
    py::dict d;
    d["live_sessions"] = st.live_sessions;
    d["max_sessions"] = st.max_sessions;
    d["reserved_tokens"] = st.reserved_tokens;
    d["budget_tokens"] = st.budget_tokens;
    d["context_tokens"] = st.context_tokens;
    d["kv_bytes_per_token"] = st.kv_bytes_per_token;
    d["reserved_bytes"] = st.reserved_bytes;
    d["evictions_ttl"] = st.evictions_ttl;
    d["evictions_lru"] = st.evictions_lru;
    d["releases"] = st.releases;
    d["supersessions"] = st.supersessions;
    d["steps"] = st.steps;
    d["tokens_computed"] = st.tokens_computed;
    d["recent_keys"] = st.recent_keys;
    d["misses"] = misses;
    d["spills"] = st.spills;
    d["restores"] = st.restores;
    d["checkpoints_taken"] = st.checkpoints_taken;
    d["checkpoint_restores"] = st.checkpoint_restores;
    d["checkpoint_tokens"] = st.checkpoint_tokens;
    d["checkpoint_bytes"] = st.checkpoint_bytes;
    d["warm_drops"] = st.warm_drops;
    d["warm_sessions"] = st.warm_sessions;
    d["warm_bytes"] = st.warm_bytes;
    d["warm_capacity"] = st.warm_capacity;
    d["restore_seconds"] = st.restore_seconds;
    py::list buckets;  // (upper bound, restores in that bucket); the last bound is +Inf
    for (size_t i = 0; i < st.restore_buckets.size(); ++i) {
        const double le = i < HOT_KV_RESTORE_BUCKETS.size() ? HOT_KV_RESTORE_BUCKETS[i]
                                                              : std::numeric_limits<double>::infinity();
        buckets.append(py::make_tuple(le, st.restore_buckets[i]));
    }
    d["restore_buckets"] = buckets;
    d["disk_sessions"] = st.disk_sessions;
    d["disk_bytes"] = st.disk_bytes;
    d["disk_capacity"] = st.disk_capacity;
    d["disk_spills"] = st.disk_spills;
    d["disk_restores"] = st.disk_restores;
    d["disk_loaded"] = st.disk_loaded;
    d["disk_failures"] = st.disk_failures;
    d["prefix_entries"] = st.prefix_entries;
    d["prefix_bytes"] = st.prefix_bytes;
    d["prefix_capacity"] = st.prefix_capacity;
    d["prefix_stores"] = st.prefix_stores;
    d["prefix_hits"] = st.prefix_hits;
    d["prefix_tokens_saved"] = st.prefix_tokens_saved;
    d["prefix_evictions"] = st.prefix_evictions;
    return d;
}

// shard_error -> the llama_shard.errors class its code names
void register_errors(py::module_ & m) {
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) {
                std::rethrow_exception(p);
            }
        } catch (const shard_error & e) {
            py::object cls = py::module_::import("llama_shard.errors").attr(error_class_for(e.code));
            PyErr_SetString(cls.ptr(), e.what());
        }
    });

}

static py::dict memory_dict(const shard_memory & mem) {
    py::dict d;
    d["device"] = mem.device;
    d["device_free"] = mem.device_free;
    d["device_total"] = mem.device_total;
    d["device_model"] = mem.device_model;
    d["device_context"] = mem.device_context;
    d["device_compute"] = mem.device_compute;
    d["host_model"] = mem.host_model;
    d["host_context"] = mem.host_context;
    d["host_compute"] = mem.host_compute;
    return d;
}

// the process's backends: the CPU kernels, the GPU modules and their devices (cpu_backend.h, devices.h)
void register_backends(py::module_ & m) {
    m.def("certified_architectures", &shard_certified_architectures,
          "Architectures whose graphs honour a shard range.");
    m.def("cpu_backend", [] {
              const cpu_backend_info c = shard_cpu_backend();  // loads it first (portable builds)
              py::dict d;
              d["variant"] = c.variant;
              d["library"] = c.library;
              d["features"] = c.features;
              d["available"] = c.available;
              d["amx"] = c.amx;
              d["self_check"] = c.self_check;
              d["fallbacks"] = c.fallbacks;
              d["flash_attn_tiled_rows"] = c.flash_attn_tiled_rows;
              return d;
          },
          "The CPU kernels this process runs, after the start-up self-check: variant (a portable build's "
          "libggml-cpu-<variant>.so, or 'built in'), library, features (instruction sets compiled in), "
          "available (the variants shipped), amx (AMX kernels in use), self_check (one line), fallbacks "
          "(each failed probe and what runs instead), flash_attn_tiled_rows (steps of this many query rows or more "
          "take patch 0010's flash-attention kernel; 0: upstream's kernels).");
    m.def("devices", [] {
              std::vector<device_info> found;
              {
                  py::gil_scoped_release release;  // loading a GPU module initialises its driver
                  found = shard_devices();
              }
              py::list out;
              for (const device_info & d : found) {
                  py::dict e;
                  e["name"] = d.name;
                  e["description"] = d.description;
                  e["backend"] = d.backend;
                  e["type"] = d.type;
                  e["memory_free"] = d.memory_free;
                  e["memory_total"] = d.memory_total;
                  out.append(e);
              }
              return out;
          },
          "The GPU devices ggml lists (ggml's names, e.g. 'Vulkan0'), each with its description, backend, "
          "type ('gpu' or 'igpu') and memory (free, total bytes). Loads the GPU modules this build ships "
          "where their driver's loader exists.");
    m.def("gpu_backends", [] {
              py::gil_scoped_release release;
              return shard_gpu_backends();
          },
          "One line per GPU module this build ships: loaded (with its device count) or why not.");
    m.attr("CPU_DEVICE") = CPU_DEVICE;
    m.def("is_cpu_device", &is_cpu_device, py::arg("name"),
          "Whether a device name is the CPU (any case): the one test of it.");
}

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

// ModelInfo and ShardModel: a shard's weights and its tokenizer (shard_model.h)
void register_model(py::module_ & m) {
    py::class_<shard_model_info>(m, "ModelInfo")
        .def_readonly("architecture", &shard_model_info::architecture)
        .def_readonly("n_layer", &shard_model_info::n_layer)
        .def_readonly("first", &shard_model_info::first)
        .def_readonly("last", &shard_model_info::last)
        .def_readonly("is_head", &shard_model_info::is_head)
        .def_readonly("is_tail", &shard_model_info::is_tail)
        .def_readonly("n_embd", &shard_model_info::n_embd)
        .def_readonly("n_vocab", &shard_model_info::n_vocab)
        .def_readonly("n_head", &shard_model_info::n_head)
        .def_readonly("n_head_kv", &shard_model_info::n_head_kv)
        .def_readonly("head_dim", &shard_model_info::head_dim)
        .def_readonly("n_ctx_train", &shard_model_info::n_ctx_train)
        .def_readonly("kv_dtype", &shard_model_info::kv_dtype)
        .def_readonly("weight_bytes", &shard_model_info::weight_bytes)
        .def_readonly("kv_bytes_per_token", &shard_model_info::kv_bytes_per_token)
        .def_readonly("sliding_window", &shard_model_info::sliding_window)
        .def_readonly("recurrent_bytes", &shard_model_info::recurrent_bytes)
        .def_readonly("swa_pattern", &shard_model_info::swa_pattern)
        .def_readonly("device", &shard_model_info::device)
        .def_readonly("device_description", &shard_model_info::device_description)
        .def_readonly("device_note", &shard_model_info::device_note)
        .def_readonly("gpu_layers", &shard_model_info::gpu_layers)
        .def_readonly("cpu_moe_layers", &shard_model_info::cpu_moe_layers)
        .def_readonly("output_on_device", &shard_model_info::output_on_device)
        .def_property_readonly("n_owned_layers", &shard_model_info::n_owned_layers)
        .def("__repr__", [](const shard_model_info & i) {
            return "ModelInfo(architecture='" + i.architecture + "', layers=" + std::to_string(i.first) + "-" +
                   std::to_string(i.last) + " of " + std::to_string(i.n_layer) + ", n_embd=" + std::to_string(i.n_embd) +
                   ", n_vocab=" + std::to_string(i.n_vocab) + ", weight_bytes=" + std::to_string(i.weight_bytes) + ")";
        });

    py::class_<shard_model>(m, "ShardModel")
        .def(py::init([](const std::string & path, std::optional<std::pair<int32_t, int32_t>> layers, std::optional<int32_t> n_threads,
                         const std::string & device, int32_t gpu_layers, int32_t cpu_moe_layers) {
                 shard_model_params params;
                 params.path       = path;
                 params.layers     = layers;
                 params.n_threads  = n_threads.value_or(0);
                 params.device     = device;
                 params.gpu_layers = gpu_layers;
                 params.cpu_moe_layers = cpu_moe_layers;
                 py::gil_scoped_release release;  // loading reads the whole file; no Python object is touched
                 return std::make_unique<shard_model>(params);
             }),
             py::arg("path"), py::arg("layers") = py::none(), py::arg("n_threads") = py::none(),
             py::arg("device") = CPU_DEVICE, py::arg("gpu_layers") = -1, py::arg("cpu_moe_layers") = 0)
        .def_property_readonly("info", &shard_model::info, py::return_value_policy::reference_internal)
        .def_property_readonly("path", &shard_model::path)
        .def_property_readonly("n_threads", &shard_model::n_threads)
        .def_property_readonly("token_eos", &shard_model::token_eos)
        .def_property_readonly("token_bos_added", &shard_model::token_bos_added)
        .def_property_readonly("eog_tokens", &shard_model::eog_tokens)
        .def_property_readonly("chat_template", &shard_model::chat_template)
        .def("apply_chat_template", [](const shard_model & self, const std::vector<std::pair<std::string, std::string>> & messages,
                                       bool add_assistant) { return self.apply_chat_template(messages, add_assistant); },
             py::arg("messages"), py::arg("add_assistant") = true)
        .def("tokenize", [](const shard_model & self, const std::string & text, bool add_special, bool parse_special) {
                 py::gil_scoped_release release;  // tokenizing a long text; only C++ strings are touched
                 return self.tokenize(text, add_special, parse_special);
             }, py::arg("text"), py::arg("add_special") = true, py::arg("parse_special") = true)
        .def("detokenize", [](const shard_model & self, const py::object & ids) {
                 std::vector<int32_t> tokens = tokens_from_python(ids, self.info().n_vocab);
                 std::string text;
                 {
                     py::gil_scoped_release release;  // the ids were copied above
                     text = self.detokenize(tokens);
                 }
                 // a character split across tokens (the ids end inside it) becomes U+FFFD, never an
                 // exception: a stream detokenizes after every token
                 PyObject * str = PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "replace");
                 if (str == nullptr) {
                     throw py::error_already_set();
                 }
                 return py::reinterpret_steal<py::str>(str);
             }, py::arg("ids"))
        .def("token_bytes", [](const shard_model & self, int32_t id) {
                 return py::bytes(self.detokenize({id}));  // a token inside a UTF-8 character: its own bytes
             }, py::arg("id"), "One token's text as bytes, as detokenize([id]) renders it before UTF-8 decoding");

}

// ShardContext: one bounded llama_context over a shard
void register_context(py::module_ & m) {
    py::class_<shard_context>(m, "ShardContext")
        .def(py::init([](const shard_model & model, int32_t n_ctx, int32_t n_seq_max, int32_t n_batch, std::optional<int32_t> n_threads,
                         bool kv_unified, bool swa_full, bool flash_attn) {
                 shard_context_params params;
                 params.kv_unified = kv_unified;
                 params.swa_full   = swa_full;
                 params.flash_attn = flash_attn;
                 params.n_ctx     = n_ctx;
                 params.n_seq_max = n_seq_max;
                 params.n_batch   = n_batch;
                 params.n_threads = n_threads.value_or(0);
                 py::gil_scoped_release release;  // allocating the KV cache; only C++ objects are touched
                 return std::make_unique<shard_context>(model, params);
             }),
             py::arg("model"), py::arg("n_ctx") = 4096, py::arg("n_seq_max") = 4, py::arg("n_batch") = 512,
             py::arg("n_threads") = py::none(), py::arg("kv_unified") = true, py::arg("swa_full") = true,
             py::arg("flash_attn") = true, py::keep_alive<1, 2>())  // the context keeps its model alive
        .def_property_readonly("n_ctx", &shard_context::n_ctx)
        .def_property_readonly("n_seq_max", &shard_context::n_seq_max)
        .def_property_readonly("n_batch", &shard_context::n_batch)
        .def_property_readonly("n_ctx_seq", &shard_context::n_ctx_seq)
        .def_property_readonly("kv_unified", &shard_context::kv_unified)
        .def_property_readonly("n_cells_used", [](const shard_context & self) {
                 py::gil_scoped_release release;  // waits for the context mutex, held for a whole forward
                 return self.n_cells_used();
             })
        .def("forward", [](shard_context & self, int32_t seq_id, int32_t pos, const py::object & tokens, const py::object & hidden) {
                 const shard_model_info & info = self.model().info();
                 py_input p;
                 parse_input(p, info, tokens, hidden);
                 // a bad n_tokens must not size an allocation; the rest is validated by forward()
                 check_batch_size(p.input, self.n_batch());
                 py::array_t<float> out = output_array(info, p.input.n_tokens);
                 float * dst = out.mutable_data();
                 {
                     py::gil_scoped_release release;  // inputs were copied or pinned above; the output array is owned by this frame
                     self.forward(seq_id, pos, p.input, dst);
                 }
                 return out;
             },
             py::arg("seq_id"), py::arg("pos"), py::arg("tokens") = py::none(), py::arg("hidden") = py::none())
        .def("forward_batch", [](shard_context & self, const py::list & items) {
                 // items: (seq_id, pos, tokens, hidden) tuples of distinct sequences; one output each
                 const shard_model_info & info = self.model().info();
                 std::vector<py_input> inputs(items.size());
                 std::vector<shard_context::batch_item> batch;
                 py::list outs;
                 for (size_t i = 0; i < items.size(); ++i) {
                     py::tuple t = py::cast<py::tuple>(items[i]);
                     if (t.size() != 4) {
                         throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "an item is (seq_id, pos, tokens, hidden)");
                     }
                     parse_input(inputs[i], info, t[2], t[3]);
                     check_batch_size(inputs[i].input, self.n_batch());
                     py::array_t<float> out = output_array(info, inputs[i].input.n_tokens);
                     batch.push_back({py::cast<int32_t>(t[0]), py::cast<int32_t>(t[1]), inputs[i].input, out.mutable_data()});
                     outs.append(out);
                 }
                 {
                     py::gil_scoped_release release;  // the batch holds copies and pinned buffers kept alive by this frame
                     self.forward_batch(batch);
                 }
                 return outs;
             }, py::arg("items"))
        .def_property_readonly("n_decode_calls", [](const shard_context & self) {
                 py::gil_scoped_release release;  // waits for the context mutex, held for a whole forward
                 return self.n_decode_calls();
             })
        .def_property_readonly("whole_rows_verdicts", [](const shard_context & self) {
                 std::map<int32_t, std::string> out;
                 {
                     py::gil_scoped_release release;  // waits for the context mutex, held for a whole forward
                     out = self.whole_rows_verdicts();
                 }
                 return out;
             }, "See HotKvEngine.whole_rows_verdicts")
        .def("seq_rm", [](shard_context & self, int32_t seq_id, int32_t p0) {
                 py::gil_scoped_release release;  // waits for the context mutex, held for a whole forward
                 return self.seq_rm(seq_id, p0);
             }, py::arg("seq_id"), py::arg("p0"))
        .def("seq_pos_max", [](const shard_context & self, int32_t seq_id) {
                 py::gil_scoped_release release;  // waits for the context mutex, held for a whole forward
                 return self.seq_pos_max(seq_id);
             }, py::arg("seq_id"));

}

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

// StepTicket and StepLoop: continuous batching
void register_step_loop(py::module_ & m) {
    py::class_<step_ticket, std::shared_ptr<step_ticket>>(m, "StepTicket",
        "A step queued on a StepLoop: wait() for it (the GIL is released), then read result and output")
        .def_readonly("session_id", &step_ticket::session_id)
        .def("done", &step_ticket::done)
        .def("wait", [](step_ticket & t, std::optional<double> timeout) {
                 py::gil_scoped_release release;  // safe: the ticket is kept alive by the caller's reference
                 if (!timeout) {
                     t.wait();
                     return true;
                 }
                 return t.wait_for(*timeout);
             }, py::arg("timeout") = py::none(), "Blocks until the step completed (or timeout seconds); True when done")
        .def_property_readonly("result", &step_ticket::result)
        .def_property_readonly("output", [](const py::object & self) {
                 return ticket_output(self.cast<std::shared_ptr<step_ticket>>(), self);
             }, "The output (no copy; None unless the step completed OK): hidden rows, or the tail's logits");

    py::class_<step_loop>(m, "StepLoop", "Continuous batching: a native thread forms engine steps from what is pending")
        .def(py::init([](hot_kv_engine & engine, int32_t max_step_tokens, int32_t max_step_sessions, int32_t prefill_chunk,
                         double gather_s) {
                 step_loop_config cfg;
                 cfg.max_step_tokens   = max_step_tokens;
                 cfg.max_step_sessions = max_step_sessions;
                 cfg.prefill_chunk     = prefill_chunk;
                 cfg.gather_s          = gather_s;
                 return std::make_unique<step_loop>(engine, cfg);
             }),
             py::arg("engine"), py::arg("max_step_tokens") = 0, py::arg("max_step_sessions") = 0,
             py::arg("prefill_chunk") = step_loop_config{}.prefill_chunk, py::arg("gather_s") = step_loop_config{}.gather_s,
             py::keep_alive<1, 2>())  // the loop keeps its engine alive
        .def_property_readonly("max_step_tokens", [](const step_loop & l) { return l.config().max_step_tokens; })
        .def_property_readonly("max_step_sessions", [](const step_loop & l) { return l.config().max_step_sessions; })
        .def_property_readonly("prefill_chunk", [](const step_loop & l) { return l.config().prefill_chunk; })
        .def("ticket", [](const step_loop & l, const py::object & step, double now, int notify_fd) {
                 return make_ticket(l, l.engine().model().info(), step, now, notify_fd);
             }, py::arg("step"), py::arg("now"), py::arg("notify_fd") = -1,
             "A ticket for a Step (validated and copied; raises InvalidInputError); not queued yet")
        .def("submit", [](step_loop & l, const std::vector<std::shared_ptr<step_ticket>> & tickets) {
                 l.submit_many(tickets);  // a short lock: no GIL release needed
             }, py::arg("tickets"), "Queues tickets together (a micro-batch shares a step when the caps allow)")
        .def("session_left", &step_loop::session_left, py::arg("session_id"),
             "A released session: the loop stops waiting for its next step")
        .def("close", [](step_loop & l) {
                 py::gil_scoped_release release;  // pending steps finish first; none of them needs the GIL
                 l.close();
             })
        .def("stats", [](const step_loop & l) {
                 const step_loop_stats st = l.stats();
                 py::dict d;
                 d["steps"] = st.steps;
                 d["requests"] = st.requests;
                 d["chunks"] = st.chunks;
                 d["tokens"] = st.tokens;
                 d["busy_seconds"] = st.busy_seconds;
                 d["pending"] = st.pending;
                 return d;
             });
}

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

// SamplingParams and TokenSampler: llama.cpp's sampler chain for one session (token_sampler.h)
void register_sampling(py::module_ & m) {
    const sampling_params d;
    m.attr("MAX_LOGIT_BIAS") = SAMPLING_MAX_LOGIT_BIAS;
    m.attr("MAX_GRAMMAR_BYTES") = SAMPLING_MAX_GRAMMAR_BYTES;
    m.def("json_schema_to_grammar", [](const std::string & schema_json) {
              py::gil_scoped_release release;  // a large schema takes a while; only C++ objects are touched
              return json_schema_to_gbnf(schema_json);
          }, py::arg("schema_json"),
          "GBNF (start rule `root`) for a JSON Schema given as JSON text, by the pinned llama.cpp's converter; "
          "InvalidInputError for a schema it cannot take");
    m.def("grammar_problem", [](const shard_model & model, const std::string & grammar) -> py::object {
              std::string why;
              {
                  py::gil_scoped_release release;  // llama.cpp's parser: a grammar may take long; strings only
                  why = grammar_problem(llama_model_get_vocab(model.raw()), grammar);
              }
              return why.empty() ? py::object(py::none()) : py::object(py::str(why));
          }, py::arg("model"), py::arg("grammar"),
          "Why llama.cpp's grammar sampler would not take this GBNF over the model's vocabulary, or None");
    py::class_<sampling_params>(m, "SamplingParams",
        "Sampling parameters (sampling_params): defaults leave every sampler but dist off; check() the one check of "
        "their ranges")
        .def(py::init([](float temperature, int32_t top_k, float top_p, float min_p, int32_t penalty_last_n,
                         float penalty_repeat, float penalty_freq, float penalty_present, uint32_t seed,
                         const std::vector<std::pair<int32_t, float>> & logit_bias, const std::string & grammar) {
                 sampling_params p{temperature, top_k, top_p, min_p, penalty_last_n, penalty_repeat, penalty_freq,
                                   penalty_present, seed, {}, grammar};
                 for (const auto & [token, bias] : logit_bias) {
                     p.logit_bias.push_back(token_bias{token, bias});
                 }
                 return p;
             }),
             py::kw_only(), py::arg("temperature") = d.temperature, py::arg("top_k") = d.top_k, py::arg("top_p") = d.top_p,
             py::arg("min_p") = d.min_p, py::arg("penalty_last_n") = d.penalty_last_n,
             py::arg("penalty_repeat") = d.penalty_repeat, py::arg("penalty_freq") = d.penalty_freq,
             py::arg("penalty_present") = d.penalty_present, py::arg("seed") = d.seed,
             py::arg("logit_bias") = std::vector<std::pair<int32_t, float>>{}, py::arg("grammar") = std::string())
        .def_readonly("temperature", &sampling_params::temperature)
        .def_readonly("top_k", &sampling_params::top_k)
        .def_readonly("top_p", &sampling_params::top_p)
        .def_readonly("min_p", &sampling_params::min_p)
        .def_readonly("penalty_last_n", &sampling_params::penalty_last_n)
        .def_readonly("penalty_repeat", &sampling_params::penalty_repeat)
        .def_readonly("penalty_freq", &sampling_params::penalty_freq)
        .def_readonly("penalty_present", &sampling_params::penalty_present)
        .def_readonly("seed", &sampling_params::seed)
        .def_property_readonly("logit_bias", [](const sampling_params & p) {
                 py::list out;
                 for (const token_bias & b : p.logit_bias) {
                     out.append(py::make_tuple(b.token, b.bias));
                 }
                 return out;
             }, "[(token, bias), ...] in the order given")
        .def_readonly("grammar", &sampling_params::grammar)
        .def("check", &sampling_check, py::arg("n_vocab"), py::arg("max_penalty_last_n"),
             "InvalidInputError naming the first parameter outside its range")
        .def("problem", [](const sampling_params & p, int32_t n_vocab, int32_t max_penalty_last_n) -> py::object {
                 const sampling_problem problem = sampling_find_problem(p, n_vocab, max_penalty_last_n);
                 if (problem.field.empty()) {
                     return py::none();
                 }
                 return py::make_tuple(problem.field, problem.message);
             }, py::arg("n_vocab"), py::arg("max_penalty_last_n"),
             "(field, why) of the first parameter outside its range, or None: the one statement of the ranges")
        .def("__repr__", [](const sampling_params & p) {
            return "SamplingParams(temperature=" + std::to_string(p.temperature) + ", top_k=" + std::to_string(p.top_k) +
                   ", top_p=" + std::to_string(p.top_p) + ", min_p=" + std::to_string(p.min_p) + ", penalty_last_n=" +
                   std::to_string(p.penalty_last_n) + ", penalty_repeat=" + std::to_string(p.penalty_repeat) +
                   ", penalty_freq=" + std::to_string(p.penalty_freq) + ", penalty_present=" +
                   std::to_string(p.penalty_present) + ", seed=" + std::to_string(p.seed) + ", logit_bias=[" +
                   std::to_string(p.logit_bias.size()) + " tokens], grammar=" + std::to_string(p.grammar.size()) +
                   " bytes)";
        });

    py::class_<token_sampler>(m, "TokenSampler",
        "One session's sampler: llama.cpp's logit_bias -> penalties -> top_k -> top_p -> min_p -> temperature -> dist(seed). Built "
        "from the tokens it has accepted and the draws it has made, so a replay gives the same tokens")
        .def(py::init([](int32_t n_vocab, const sampling_params & params, int32_t max_penalty_last_n,
                         std::vector<int32_t> history, uint64_t draws, const shard_model * model,
                         std::vector<int32_t> generated) {
                 const llama_vocab * vocab = model != nullptr ? llama_model_get_vocab(model->raw()) : nullptr;
                 py::gil_scoped_release release;  // a grammar's parse and replay may take long; C++ values only
                 return token_sampler::resume(n_vocab, params, max_penalty_last_n, history, draws, vocab, generated);
             }),
             py::arg("n_vocab"), py::arg("params"), py::arg("max_penalty_last_n"), py::kw_only(),
             py::arg("history") = std::vector<int32_t>{}, py::arg("draws") = 0, py::arg("model") = nullptr,
             py::arg("generated") = std::vector<int32_t>{},
             "`model`: the vocabulary a grammar's tokens come from (needed with one); `generated`: every token "
             "sampled so far (draws of them), which the grammar replays")
        .def("sample", [](token_sampler & s, py::array logits) {
                 if (!py::isinstance<py::array_t<float>>(logits) || logits.ndim() != 1 ||
                     !(logits.flags() & py::array::c_style)) {
                     throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "logits must be a contiguous 1-D numpy float32 array");
                 }
                 const float * row = static_cast<const float *>(logits.data());  // the caller holds the array
                 const size_t n = (size_t) logits.shape(0);
                 py::gil_scoped_release release;  // a grammar's mask over the vocabulary may take long
                 return s.sample(row, n);
             },
             py::arg("logits"), "One draw over a row of n_vocab logits (not accepted: call accept with the token kept)")
        .def("accept", &token_sampler::accept, py::arg("token"), "The penalties remember this token (a prompt's)")
        .def("accept_sampled", &token_sampler::accept_sampled, py::arg("token"), py::call_guard<py::gil_scoped_release>(),
             "A sampled token: the grammar advances over it (InvalidInputError, nothing changed, if it does not fit), "
             "then the penalties remember it")
        .def_property_readonly("draws", &token_sampler::draws)
        .def_property_readonly("params", &token_sampler::params);
}

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
    py::class_<hot_kv_engine>(m, "HotKvEngine")
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
        .def_property_readonly("n_batch", [](const hot_kv_engine & e) { return e.config().n_batch; })
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
             }, py::arg("session_id"), py::arg("epoch"), py::arg("now"))
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
             }, py::arg("key"), "The length of the prefix stored under `key`, 0 when none")
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

PYBIND11_MODULE(_native, m) {
    m.doc() = "llama-shard native engine: a layer range of a GGUF model on a patched llama.cpp";
    register_errors(m);
    register_backends(m);
    register_limits(m);
    register_model(m);
    register_context(m);
    register_contract_types(m);
    register_step_loop(m);
    register_config(m);
    register_engine(m);
    register_sampling(m);
}
