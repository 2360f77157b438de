// Which CPU kernels this process runs.
//
// A portable build (CMake option LLAMA_SHARD_PORTABLE: ggml's dynamic backends) ships one
// libggml-cpu-<variant>.so per instruction-set level (x64 baseline, sse42, ..., haswell = AVX2,
// skylakex = AVX-512, ...) next to libggml.so; the first model load picks the variant ggml scores
// best for this CPU, or the one the environment variable LLAMA_SHARD_CPU_VARIANT names (to run a
// lower level on purpose: tests compare them). A source build compiles the kernels into the module
// for the build machine (GGML_NATIVE) and loads nothing.
#pragma once

#include <string>
#include <vector>

namespace llama_shard {

struct cpu_backend_info {
    std::string              variant;    // "haswell", "x64", ...; "built in" for a source build
    std::string              library;    // the shared object the kernels run from
    std::vector<std::string> features;   // the instruction sets those kernels use (ggml's list)
    std::vector<std::string> available;  // the variants a portable build found (empty otherwise)
};

// loads the CPU backend once per process (a no-op for a source build); throws
// shard_error(SHARD_ERRC_MODEL_LOAD) when LLAMA_SHARD_CPU_VARIANT names a variant that is not
// there or that this CPU cannot run, or when no variant loads
void shard_load_cpu_backend();

// what was loaded (loads it first if nothing was)
cpu_backend_info shard_cpu_backend();

}  // namespace llama_shard
