#pragma once

// llama_shard._native: the only files that include pybind11 (this folder), one per bound class or
// area; module.cpp calls their register functions in a fixed order.
//
// Arrays cross without extra copies: hidden input is read in place (it must already be a
// C-contiguous float32 (n_tokens, n_embd) array; nothing is converted silently), outputs are
// allocated as numpy arrays and written by the engine directly. The GIL is released around every
// call that computes or loads. shard_error is translated to the classes of llama_shard.errors.
//
// Every file of the module includes this header, so all of them see the same type casters
// (pybind11/stl.h among them): a type converts the same way whichever file binds it.

#include "llama_shard/shard_context.h"
#include "llama_shard/shard_model.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace llama_shard::bindings {

// --- the register functions, in the order module.cpp calls them (a type is registered before a
// signature that names it is generated) ---
void register_errors(py::module_ & m);          // module.cpp
void register_backends(py::module_ & m);        // backends.cpp
void register_limits(py::module_ & m);          // limits.cpp
void register_model(py::module_ & m);           // model.cpp
void register_context(py::module_ & m);         // context.cpp
void register_contract_types(py::module_ & m);  // contract.cpp
void register_step_loop(py::module_ & m);       // step_loop.cpp
void register_config(py::module_ & m);          // config.cpp
void register_engine(py::module_ & m);          // engine.cpp
void register_sampling(py::module_ & m);        // sampling.cpp

// --- helpers shared by several files (helpers.cpp) ---

// one field of a struct as Python sees it: a key and its value, a Python object as it is and
// anything else as pybind11 casts it (what assigning it to a dict item does)
struct dict_field {
    const char * key;
    py::object   value;
    template <class T> dict_field(const char * k, T && v) : key(k), value(to_object(std::forward<T>(v))) {}

private:
    template <class T> static py::object to_object(T && v) {
        if constexpr (std::is_base_of_v<py::handle, std::decay_t<T>>) {
            return py::reinterpret_borrow<py::object>(v);
        } else {
            return py::cast(std::forward<T>(v));
        }
    }
};

// a C++ struct as a Python dict, its fields in the order given: the one way the module builds one
py::dict to_dict(std::initializer_list<dict_field> fields);

// token ids from any 1-D integer sequence, range-checked before narrowing to int32
std::vector<int32_t> tokens_from_python(const py::object & obj, int32_t n_vocab);

// a hidden-state array is used in place: it must already be float32, 2-D and C-contiguous
py::array_t<float> hidden_from_python(const py::object & obj, int32_t n_embd);

// one step's input from Python, owning whatever the shard_input points at
struct py_input {
    shard_input          input;
    std::vector<int32_t> tokens;
    py::array_t<float>   hidden;
};

// exactly one of tokens / hidden (or neither: an empty input, refused by whoever takes it)
void parse_input(py_input & p, const shard_model_info & info, const py::object & tokens, const py::object & hidden);

// a step's output, written by the engine: the tail's logits (n_vocab) or n_tokens hidden rows
py::array_t<float> output_array(const shard_model_info & info, int64_t n_tokens);

// a step's size is checked before its output is allocated
void check_batch_size(const shard_input & input, int32_t n_batch);

} // namespace llama_shard::bindings
