// The module itself: PYBIND11_MODULE, which registers each part in order (bindings.h), and the
// translation of shard_error to llama_shard.errors, which every part relies on. A file of its own
// so the order of registration is read in one place.

#include "bindings.h"

#include "llama_shard/shard_error.h"

namespace llama_shard::bindings {

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

} // namespace

// shard_error -> the llama_shard.errors class its code names (a translator is pybind11's, for the
// whole process: the module is not needed)
void register_errors(py::module_ &) {
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

} // namespace llama_shard::bindings

PYBIND11_MODULE(_native, m) {
    using namespace llama_shard::bindings;
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
