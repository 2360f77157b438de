#pragma once

// The error model of the native engine.
//
// Expected outcomes (cache misses, stale epochs, budget refusals) are values, never exceptions.
// A shard_error means the caller did something wrong (invalid input, a file that cannot be loaded)
// or llama.cpp failed a computation; in every case the engine's state is unchanged when it is
// thrown: validation runs before anything reaches llama.cpp, and a failed decode is rolled back.

#include <stdexcept>
#include <string>

namespace llama_shard {

enum shard_errc {
    SHARD_ERRC_INVALID_ARGUMENT,         // a bad argument from the caller (shape, range, id, ...)
    SHARD_ERRC_MODEL_LOAD,               // the GGUF is missing, unreadable or rejected by llama.cpp
    SHARD_ERRC_UNSUPPORTED_ARCHITECTURE, // a shard range on an architecture that is not certified
    SHARD_ERRC_CAPACITY,                 // the context has no room (cells or sequences)
    SHARD_ERRC_COMPUTE,                  // llama_decode failed; the call's positions were rolled back
};

const char * shard_errc_name(shard_errc code);

struct shard_error : std::runtime_error {
    shard_error(shard_errc code, const std::string & message) : std::runtime_error(message), code(code) {}

    shard_errc code;
};

} // namespace llama_shard
