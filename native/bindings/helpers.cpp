// The helpers several bound classes share: Python input to engine input (token ids, hidden rows,
// one step's input), output arrays, and the one struct-to-dict builder. A file of its own so each
// class's file holds its bindings only.

#include "bindings.h"

#include <string>

namespace llama_shard::bindings {

py::dict to_dict(std::initializer_list<dict_field> fields) {
    py::dict d;
    for (const dict_field & f : fields) {
        d[f.key] = f.value;
    }
    return d;
}

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

void check_batch_size(const shard_input & input, int32_t n_batch) {
    if (input.n_tokens < 1 || input.n_tokens > n_batch) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "a step takes 1 to n_batch (" + std::to_string(n_batch) +
                          ") tokens, got " + std::to_string(input.n_tokens));
    }
}

} // namespace llama_shard::bindings
