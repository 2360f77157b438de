// ModelInfo and ShardModel: a shard's weights and its tokenizer (shard_model.h). A file of its own:
// one bound class (and the read-only struct that describes it) per file.

#include "bindings.h"

#include "llama_shard/devices.h"

#include <optional>
#include <string>

namespace llama_shard::bindings {

namespace {

// ModelInfo: what a loaded shard is (read-only)
void register_model_info(py::module_ & m) {
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
}

} // namespace

// ModelInfo and ShardModel: a shard's weights and its tokenizer (shard_model.h)
void register_model(py::module_ & m) {
    register_model_info(m);
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

} // namespace llama_shard::bindings
