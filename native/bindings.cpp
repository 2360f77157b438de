// llama_shard._native: the only file that includes pybind11.
//
// Arrays cross without extra copies: hidden input is read in place (it must already be a
// C-contiguous float32 (n_tokens, n_embd) array; nothing is converted silently), outputs are
// allocated as numpy arrays and written by the engine directly. The GIL is released around every
// call that computes or loads. shard_error is translated to the classes of llama_shard.errors.

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
        .def(py::init([](const shard_model & model, int32_t n_ctx, int32_t n_seq_max, int32_t n_batch, std::optional<int32_t> n_threads) {
                 shard_context_params params;
                 params.n_ctx     = n_ctx;
                 params.n_seq_max = n_seq_max;
                 params.n_batch   = n_batch;
                 params.n_threads = n_threads.value_or(0);
                 py::gil_scoped_release release;
                 return std::make_unique<shard_context>(model, params);
             }),
             py::arg("model"), py::arg("n_ctx") = 4096, py::arg("n_seq_max") = 4, py::arg("n_batch") = 512,
             py::arg("n_threads") = py::none(),
             py::keep_alive<1, 2>())  // the context keeps its model alive
        .def_property_readonly("n_ctx", &shard_context::n_ctx)
        .def_property_readonly("n_seq_max", &shard_context::n_seq_max)
        .def_property_readonly("n_batch", &shard_context::n_batch)
        .def_property_readonly("n_cells_used", [](const shard_context & self) {
                 py::gil_scoped_release release;
                 return self.n_cells_used();
             })
        .def("forward", [](shard_context & self, int32_t seq_id, int32_t pos, const py::object & tokens, const py::object & hidden) {
                 const shard_model_info & info = self.model().info();
                 shard_input input;
                 std::vector<int32_t> token_ids;
                 py::array_t<float> hidden_arr;
                 if (!tokens.is_none() && !hidden.is_none()) {
                     throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "pass exactly one of tokens or hidden, not both");
                 }
                 if (!tokens.is_none()) {
                     token_ids      = tokens_from_python(tokens, info.n_vocab);
                     input.tokens   = token_ids.data();
                     input.n_tokens = (int64_t) token_ids.size();
                     if (token_ids.empty()) {
                         input.tokens = nullptr;
                         throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "empty input: at least one token is required");
                     }
                 } else if (!hidden.is_none()) {
                     hidden_arr        = hidden_from_python(hidden, info.n_embd);
                     input.hidden      = hidden_arr.data();
                     input.n_tokens    = hidden_arr.shape(0);
                     input.hidden_cols = hidden_arr.shape(1);
                 }
                 // validate before allocating the output: a bad n_tokens must not size an allocation
                 self.validate_seq_id(seq_id);
                 self.validate_input(input);
                 py::array_t<float> out = info.is_tail
                     ? py::array_t<float>(std::vector<py::ssize_t>{info.n_vocab})
                     : py::array_t<float>(std::vector<py::ssize_t>{(py::ssize_t) input.n_tokens, info.n_embd});
                 float * dst = out.mutable_data();
                 {
                     py::gil_scoped_release release;
                     self.forward(seq_id, pos, input, dst);
                 }
                 return out;
             },
             py::arg("seq_id"), py::arg("pos"), py::arg("tokens") = py::none(), py::arg("hidden") = py::none())
        .def("seq_rm", [](shard_context & self, int32_t seq_id, int32_t p0) {
                 py::gil_scoped_release release;
                 return self.seq_rm(seq_id, p0);
             }, py::arg("seq_id"), py::arg("p0"))
        .def("seq_pos_max", [](const shard_context & self, int32_t seq_id) {
                 py::gil_scoped_release release;
                 return self.seq_pos_max(seq_id);
             }, py::arg("seq_id"));
}
