// llama_shard._native: the only file that includes pybind11.
//
// Arrays cross without extra copies: hidden input is read in place (it must already be a
// C-contiguous float32 (n_tokens, n_embd) array; nothing is converted silently), outputs are
// allocated as numpy arrays and written by the engine directly. The GIL is released around every
// call that computes or loads. shard_error is translated to the classes of llama_shard.errors.

#include "llama_shard/hot_kv_engine.h"
#include "llama_shard/shard_context.h"
#include "llama_shard/shard_model.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

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

void check_step_size(const hot_kv_engine & e, const shard_input & input) {
    check_batch_size(input, e.config().n_batch);
}

// one prefill or decode on the engine: (result, output or None)
std::pair<hot_kv_result, py::object> single_step(hot_kv_engine & e, hot_kv_step_kind kind, const std::string & sid,
                                                 int64_t epoch, double now, int32_t position, const py::object & tokens,
                                                 const py::object & hidden) {
    const shard_model_info & info = e.model().info();
    py_input p;
    parse_input(p, info, tokens, hidden);
    check_step_size(e, p.input);
    py::array_t<float> out = output_array(info, p.input.n_tokens);
    float * dst = out.mutable_data();
    hot_kv_result r;
    {
        py::gil_scoped_release release;
        r = kind == HOT_KV_STEP_PREFILL ? e.prefill(sid, epoch, position, p.input, dst, now)
                                        : e.decode(sid, epoch, position, p.input, dst, now);
    }
    return {r, r.status == SHARD_STATUS_OK ? py::object(out) : py::object(py::none())};
}

} // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() = "llama-shard native engine: a layer range of a GGUF model on a patched llama.cpp";

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

    m.def("certified_architectures", [] { return std::vector<std::string>{"llama", "qwen2", "qwen3"}; },
          "Architectures whose graphs honour a shard range.");

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
        .def_property_readonly("n_owned_layers", &shard_model_info::n_owned_layers)
        .def("__repr__", [](const shard_model_info & i) {
            return "ModelInfo(architecture='" + i.architecture + "', layers=" + std::to_string(i.first) + "-" +
                   std::to_string(i.last) + " of " + std::to_string(i.n_layer) + ", n_embd=" + std::to_string(i.n_embd) +
                   ", n_vocab=" + std::to_string(i.n_vocab) + ", weight_bytes=" + std::to_string(i.weight_bytes) + ")";
        });

    py::class_<shard_model>(m, "ShardModel")
        .def(py::init([](const std::string & path, std::optional<std::pair<int32_t, int32_t>> layers, std::optional<int32_t> n_threads) {
                 shard_model_params params;
                 params.path      = path;
                 params.layers    = layers;
                 params.n_threads = n_threads.value_or(0);
                 py::gil_scoped_release release;
                 return std::make_unique<shard_model>(params);
             }),
             py::arg("path"), py::arg("layers") = py::none(), py::arg("n_threads") = py::none())
        .def_property_readonly("info", &shard_model::info, py::return_value_policy::reference_internal)
        .def_property_readonly("path", &shard_model::path)
        .def_property_readonly("n_threads", &shard_model::n_threads)
        .def_property_readonly("token_eos", &shard_model::token_eos)
        .def_property_readonly("chat_template", &shard_model::chat_template)
        .def("apply_chat_template", [](const shard_model & self, const std::vector<std::pair<std::string, std::string>> & messages,
                                       bool add_assistant) { return self.apply_chat_template(messages, add_assistant); },
             py::arg("messages"), py::arg("add_assistant") = true)
        .def("tokenize", [](const shard_model & self, const std::string & text) {
                 py::gil_scoped_release release;
                 return self.tokenize(text);
             }, py::arg("text"))
        .def("detokenize", [](const shard_model & self, const py::object & ids) {
                 std::vector<int32_t> tokens = tokens_from_python(ids, self.info().n_vocab);
                 py::gil_scoped_release release;
                 return self.detokenize(tokens);
             }, py::arg("ids"));

    py::class_<shard_context>(m, "ShardContext")
        .def(py::init([](const shard_model & model, int32_t n_ctx, int32_t n_seq_max, int32_t n_batch, std::optional<int32_t> n_threads,
                         bool kv_unified) {
                 shard_context_params params;
                 params.kv_unified = kv_unified;
                 params.n_ctx     = n_ctx;
                 params.n_seq_max = n_seq_max;
                 params.n_batch   = n_batch;
                 params.n_threads = n_threads.value_or(0);
                 py::gil_scoped_release release;
                 return std::make_unique<shard_context>(model, params);
             }),
             py::arg("model"), py::arg("n_ctx") = 4096, py::arg("n_seq_max") = 4, py::arg("n_batch") = 512,
             py::arg("n_threads") = py::none(), py::arg("kv_unified") = true,
             py::keep_alive<1, 2>())  // the context keeps its model alive
        .def_property_readonly("n_ctx", &shard_context::n_ctx)
        .def_property_readonly("n_seq_max", &shard_context::n_seq_max)
        .def_property_readonly("n_batch", &shard_context::n_batch)
        .def_property_readonly("n_ctx_seq", &shard_context::n_ctx_seq)
        .def_property_readonly("kv_unified", &shard_context::kv_unified)
        .def_property_readonly("n_cells_used", [](const shard_context & self) {
                 py::gil_scoped_release release;
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
                     py::gil_scoped_release release;
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
                     py::gil_scoped_release release;
                     self.forward_batch(batch);
                 }
                 return outs;
             }, py::arg("items"))
        .def_property_readonly("n_decode_calls", &shard_context::n_decode_calls)
        .def("seq_rm", [](shard_context & self, int32_t seq_id, int32_t p0) {
                 py::gil_scoped_release release;
                 return self.seq_rm(seq_id, p0);
             }, py::arg("seq_id"), py::arg("p0"))
        .def("seq_pos_max", [](const shard_context & self, int32_t seq_id) {
                 py::gil_scoped_release release;
                 return self.seq_pos_max(seq_id);
             }, py::arg("seq_id"));

    py::class_<hot_kv_result>(m, "StepResult")
        .def_property_readonly("status", [](const hot_kv_result & r) { return std::string(shard_status_name(r.status)); })
        .def_property_readonly("miss", [](const hot_kv_result & r) { return std::string(shard_miss_reason_name(r.miss)); })
        .def_readonly("seq_len", &hot_kv_result::seq_len)
        .def_readonly("seq_id", &hot_kv_result::seq_id)
        .def_readonly("current_epoch", &hot_kv_result::current_epoch)
        .def_readonly("changed", &hot_kv_result::changed)
        .def_readonly("detail", &hot_kv_result::detail)
        .def("__repr__", [](const hot_kv_result & r) {
            return std::string("StepResult(") + shard_status_name(r.status) + ", miss=" + shard_miss_reason_name(r.miss) +
                   ", seq_len=" + std::to_string(r.seq_len) + ")";
        });

    py::class_<hot_kv_engine>(m, "HotKvEngine")
        .def(py::init([](const shard_model & model, int32_t max_sessions, int32_t context_tokens, int64_t budget_tokens,
                         double ttl_seconds, int32_t n_batch, std::optional<int32_t> n_threads, int32_t recent_capacity) {
                 hot_kv_config cfg;
                 cfg.max_sessions    = max_sessions;
                 cfg.context_tokens  = context_tokens;
                 cfg.budget_tokens   = budget_tokens;
                 cfg.ttl_seconds     = ttl_seconds;
                 cfg.n_batch         = n_batch;
                 cfg.n_threads       = n_threads.value_or(0);
                 cfg.recent_capacity = recent_capacity;
                 py::gil_scoped_release release;
                 return std::make_unique<hot_kv_engine>(model, cfg);
             }),
             py::arg("model"), py::arg("max_sessions"), py::arg("context_tokens"), py::arg("budget_tokens"),
             py::arg("ttl_seconds"), py::arg("n_batch") = 512, py::arg("n_threads") = py::none(),
             py::arg("recent_capacity") = 4096, py::keep_alive<1, 2>())
        .def_property_readonly("n_batch", [](const hot_kv_engine & e) { return e.config().n_batch; })
        .def("open", [](hot_kv_engine & e, const std::string & sid, int64_t epoch, double now) {
                 py::gil_scoped_release release;
                 return e.open(sid, epoch, now);
             }, py::arg("session_id"), py::arg("epoch"), py::arg("now"))
        .def("prefill", [](hot_kv_engine & e, const std::string & sid, int64_t epoch, double now, int32_t start_pos,
                           const py::object & tokens, const py::object & hidden) {
                 return single_step(e, HOT_KV_STEP_PREFILL, sid, epoch, now, start_pos, tokens, hidden);
             }, py::arg("session_id"), py::arg("epoch"), py::arg("now"), py::arg("start_pos") = -1,
             py::arg("tokens") = py::none(), py::arg("hidden") = py::none())
        .def("decode", [](hot_kv_engine & e, const std::string & sid, int64_t epoch, double now, int32_t expected_seq_len,
                          const py::object & tokens, const py::object & hidden) {
                 return single_step(e, HOT_KV_STEP_DECODE, sid, epoch, now, expected_seq_len, tokens, hidden);
             }, py::arg("session_id"), py::arg("epoch"), py::arg("now"), py::arg("expected_seq_len") = -1,
             py::arg("tokens") = py::none(), py::arg("hidden") = py::none())
        .def("step", [](hot_kv_engine & e, const py::list & requests, double now) {
                 // requests: (session_id, epoch, "prefill" | "decode", position, tokens, hidden) tuples
                 const shard_model_info & info = e.model().info();
                 const size_t n = requests.size();
                 std::vector<py_input> inputs(n);
                 std::vector<py::object> outs(n, py::none());
                 std::vector<hot_kv_result> results(n);
                 std::vector<hot_kv_request> batch;
                 std::vector<size_t> batch_index;
                 for (size_t i = 0; i < n; ++i) {
                     try {
                         py::tuple t = py::cast<py::tuple>(requests[i]);
                         if (t.size() != 6) {
                             throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "a request is (session_id, epoch, kind, position, tokens, hidden)");
                         }
                         hot_kv_request req;
                         req.session_id = py::cast<std::string>(t[0]);
                         req.epoch      = py::cast<int64_t>(t[1]);
                         const std::string kind = py::cast<std::string>(t[2]);
                         if (kind != "prefill" && kind != "decode") {
                             throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "kind must be 'prefill' or 'decode'");
                         }
                         req.kind     = kind == "prefill" ? HOT_KV_STEP_PREFILL : HOT_KV_STEP_DECODE;
                         req.position = py::cast<int32_t>(t[3]);
                         parse_input(inputs[i], info, t[4], t[5]);
                         check_step_size(e, inputs[i].input);
                         req.input = inputs[i].input;
                         py::array_t<float> out = output_array(info, req.input.n_tokens);
                         req.out = out.mutable_data();
                         outs[i] = out;
                         batch.push_back(std::move(req));
                         batch_index.push_back(i);
                     } catch (const shard_error & err) {
                         results[i].status = SHARD_STATUS_INVALID_INPUT;
                         results[i].detail = err.what();
                     } catch (const py::cast_error & err) {
                         results[i].status = SHARD_STATUS_INVALID_INPUT;
                         results[i].detail = std::string("malformed request: ") + err.what();
                     }
                 }
                 if (!batch.empty()) {
                     std::vector<hot_kv_result> got;
                     {
                         py::gil_scoped_release release;
                         got = e.step(batch, now);
                     }
                     for (size_t k = 0; k < got.size(); ++k) {
                         results[batch_index[k]] = got[k];
                     }
                 }
                 py::list answer;
                 for (size_t i = 0; i < n; ++i) {
                     const bool ok = results[i].status == SHARD_STATUS_OK;
                     answer.append(py::make_tuple(results[i], ok ? outs[i] : py::object(py::none())));
                 }
                 return answer;
             }, py::arg("requests"), py::arg("now"))
        .def_property_readonly("n_decode_calls", &hot_kv_engine::n_decode_calls)
        .def("truncate", [](hot_kv_engine & e, const std::string & sid, int64_t epoch, int32_t length, double now) {
                 py::gil_scoped_release release;
                 return e.truncate(sid, epoch, length, now);
             }, py::arg("session_id"), py::arg("epoch"), py::arg("length"), py::arg("now"))
        .def("release", [](hot_kv_engine & e, const std::string & sid, int64_t epoch, double now) {
                 py::gil_scoped_release release;
                 return e.release(sid, epoch, now);
             }, py::arg("session_id"), py::arg("epoch"), py::arg("now"))
        .def("resolve", [](hot_kv_engine & e, const std::string & sid, int64_t epoch, double now) {
                 py::gil_scoped_release release;
                 return e.resolve(sid, epoch, now);
             }, py::arg("session_id"), py::arg("epoch"), py::arg("now"))
        .def("sweep", [](hot_kv_engine & e, double now) {
                 py::gil_scoped_release release;
                 return e.sweep(now);
             }, py::arg("now"))
        .def("check_invariants", [](const hot_kv_engine & e) {
                 py::gil_scoped_release release;
                 e.check_invariants();
             })
        .def("sessions", [](const hot_kv_engine & e) {
                 py::list out;
                 for (const auto & s : e.sessions()) {
                     out.append(py::make_tuple(s.session_id, s.epoch, s.seq_id, s.seq_len, s.last_used));
                 }
                 return out;
             })
        .def("stats", [](const hot_kv_engine & e) {
                 const hot_kv_stats st = e.stats();
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
                 return d;
             });
}
