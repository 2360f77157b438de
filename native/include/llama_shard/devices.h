// The compute devices beside the CPU: ggml's GPU backends (Vulkan, CUDA), loaded at run time from
// the modules a portable build ships next to libggml.so (libggml-vulkan.so, libggml-cuda.so), and
// the choice of the device a model's owned layers run on. Below the model: it includes neither
// the model nor the context.
//
// Invariants:
//  - a GPU module is loaded at most once per process, and only where its driver's loader is there
//    (libvulkan.so.1, libcuda.so.1): a node without them never loads it and runs exactly as a
//    CPU-only build; nothing is loaded until a caller asks for a device or the device list (a model
//    on the CPU never does);
//  - the devices are the ones ggml lists, by ggml's names ("Vulkan0", "CUDA0"); ggml's own filters
//    apply (a CPU-type Vulkan driver such as lavapipe is listed only when GGML_VK_VISIBLE_DEVICES
//    names it); LLAMA_SHARD_GPU_BACKENDS=vulkan|cuda|none (a comma list) limits the modules that may
//    load, so an operator can keep a node on the CPU and tests can run as a node without a GPU;
//  - choosing a device runs its self-check once per device: a short quantized matrix product (Q4_0,
//    32 rows and 1) on the device compared with the same in double precision on the host. `auto`
//    takes the first listed device that passes (none: the CPU, and the reason is kept); a device
//    named by the operator that fails is an error. LLAMA_SHARD_DEVICE_PROBE_FAIL=Vulkan0[,...]
//    makes the named devices' self-checks fail, to keep a device out of `auto` and to test the
//    fallback anywhere.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

typedef struct ggml_backend_device * ggml_backend_dev_t;

namespace llama_shard {

// where a shard's layers run unless told: every default names it (shard_model_params, the bindings,
// the flags), and is_cpu_device is the one test of it (any case)
inline constexpr const char * CPU_DEVICE = "cpu";
bool is_cpu_device(const std::string & name);

struct device_info {
    std::string name;         // ggml's name: "Vulkan0", "CUDA0"
    std::string description;  // the driver's: "NVIDIA H200", "llvmpipe (LLVM 15.0.6, 256 bits)"
    std::string backend;      // "Vulkan", "CUDA"
    std::string type;         // "gpu" or "igpu" (integrated: shares the host's memory)
    uint64_t    memory_free  = 0;
    uint64_t    memory_total = 0;
};

// the GPU modules this build ships and whether each was loaded ("Vulkan: loaded", "Vulkan: not
// loaded: no Vulkan loader (libvulkan.so.1)"); loads them first
std::vector<std::string> shard_gpu_backends();

// the GPU devices ggml lists (loads the GPU modules first)
std::vector<device_info> shard_devices();

// the device for `wanted`: "cpu" (nullptr), "auto" (the first device that passes its self-check,
// else nullptr) or a device name (case-insensitive). Throws shard_error(INVALID_ARGUMENT) for a name
// ggml does not list (naming the ones it does) and shard_error(MODEL_LOAD) when a named device fails
// its self-check. `why_cpu` receives why "auto" runs on the CPU ("" when it chose a device).
ggml_backend_dev_t shard_choose_device(const std::string & wanted, std::string * why_cpu = nullptr);

// the self-check's one-line result for a device ("passed (a Q4_0 product within 1.2e-03 of the
// largest output)" or why it failed); runs it once per device
std::string shard_device_self_check(ggml_backend_dev_t dev, bool * passed = nullptr);

// a device's info (its memory now)
device_info shard_device_info(ggml_backend_dev_t dev);

}  // namespace llama_shard
