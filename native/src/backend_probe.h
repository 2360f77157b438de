// Internal to the backends' start-up checks (cpu_backend.cpp, devices.cpp): the one computation a
// backend must get right before a model runs on it, and where ggml's modules live.
#pragma once

#include "ggml-backend.h"

#include <string>

namespace llama_shard {

// what a probe found; a CPU probe's child exits with it (a fault shows as a signal instead)
enum probe_exit : int {
    PROBE_PASSED      = 0,
    PROBE_WRONG       = 3,  // the kernels ran and computed something else
    PROBE_NO_BACKEND  = 4,  // the variant did not load (ggml refused it for this CPU)
    PROBE_NO_AMX_BUFT = 5,  // no AMX buffer type: the kernel refused the tile data
    PROBE_SETUP       = 6,  // an allocation or graph step failed
};

// a Q4_0 matrix product on `dev` (weights in `weight_buft`, nullptr: the device's own buffers)
// against the same in double precision; `error` receives the worst error relative to the largest
// output. Frees everything it allocated.
int backend_probe_product(ggml_backend_dev_t dev, ggml_backend_buffer_type_t weight_buft, int threads, double * error);

// the directory of libggml.so, where a portable build's backend modules are ("" in a static build)
std::string shard_backend_dir();

}  // namespace llama_shard
