// The process's llama.cpp backend: its initialisation and log, which CPU kernels run, and the
// start-up self-check that proves they run here. Below the model and the context: it includes neither.
//
// A portable build (CMake option LLAMA_SHARD_PORTABLE: ggml's dynamic backends) ships one
// libggml-cpu-<variant>.so per instruction-set level (x64 baseline, sse42, ..., haswell = AVX2,
// skylakex = AVX-512, sapphirerapids = AVX-512 + AMX, ...) next to libggml.so. A source build
// compiles the kernels into the module for the build machine (GGML_NATIVE) and loads nothing.
//
// The self-check runs once per process, before the first model loads. CPUID and the kernel can
// say yes while an instruction still faults (AMX tiles in a virtual machine, a compiler that drops
// the tile configuration), so each probe runs a real quantized matrix product through the kernels
// (four compute threads, checked against a scalar product) in a short-lived child process: a fault
// kills the child, not the worker.
//   - the kernels: a portable build probes its variants from ggml's best score down and loads the
//     first that passes (LLAMA_SHARD_CPU_VARIANT=name forces one; it failing is an error); a
//     source build whose built-in kernels fail cannot run here, and says so;
//   - AMX, when the loaded kernels carry it: a failing probe turns the AMX kernels off at run time
//     (patch 0006), and the AVX-512 kernels of the same build run instead.
// A fallback is written to stderr in one line naming what failed and what runs instead, and is
// reported by shard_cpu_backend(). LLAMA_SHARD_CPU_PROBE_FAIL=name[,name...] makes the named
// probes fail as a faulting instruction would (the child kills itself with SIGILL), so operators
// can turn a path off and tests can drive every fallback on any CPU: "amx" (every AMX probe),
// "built-in" (a source build's kernels) or a variant name.
#pragma once

#include <string>
#include <vector>

namespace llama_shard {

// process-wide llama.cpp initialisation (backend init, log routing); idempotent and thread-safe
void shard_backend_init();

// the last error line llama.cpp logged on this thread (used to explain load failures), and its reset
// before a call whose failure it should explain
std::string shard_last_llama_error();
void shard_clear_llama_error();

struct cpu_backend_info {
    std::string              variant;     // "haswell", "x64", ...; "built in" for a source build
    std::string              library;     // the shared object the kernels run from
    std::vector<std::string> features;    // the instruction sets those kernels use (ggml's list)
    std::vector<std::string> available;   // the variants a portable build found (empty otherwise)
    bool                     amx = false; // AMX kernels compiled into the loaded kernels and in use
    std::string              self_check;  // the self-check in one line: what passed, what fell back
    std::vector<std::string> fallbacks;   // each failed probe and what runs instead (empty: none)
    int flash_attn_tiled_rows = 0;        // steps of this many query rows or more take patch 0010's flash-attention kernel (0: upstream's kernels)
};

// the default of cpu_backend_info.flash_attn_tiled_rows: every step takes patch 0010's kernel, so a
// row's attention is the same bytes in a step of one row or of many (a verification, a re-prefill,
// a batch of sessions), and it was as fast or faster than upstream's kernels at every size measured
// (docs/benchmarks.md "Flash attention: what nothing set gets")
constexpr int DEFAULT_FLASH_ATTN_TILED_ROWS = 1;

// loads the CPU backend once per process after the self-check (a source build loads nothing);
// throws shard_error(SHARD_ERRC_MODEL_LOAD) when LLAMA_SHARD_CPU_VARIANT names a variant that is
// not there, that this CPU cannot run or that fails its probe, or when no kernels pass
void shard_load_cpu_backend();

// what was loaded (loads it first if nothing was)
cpu_backend_info shard_cpu_backend();

}  // namespace llama_shard
