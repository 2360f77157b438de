// The process's backends as Python sees them: the CPU kernels, the GPU modules and their devices
// (cpu_backend.h, devices.h). A file of its own: these are the process's, not a model's.

#include "bindings.h"

#include "llama_shard/cpu_backend.h"
#include "llama_shard/devices.h"

namespace llama_shard::bindings {

// the process's backends: the CPU kernels, the GPU modules and their devices (cpu_backend.h, devices.h)
void register_backends(py::module_ & m) {
    m.def("certified_architectures", &shard_certified_architectures,
          "Architectures whose graphs honour a shard range.");
    m.def("cpu_backend", [] {
              const cpu_backend_info c = shard_cpu_backend();  // loads it first (portable builds)
              return to_dict({{"variant", c.variant},
                              {"library", c.library},
                              {"features", c.features},
                              {"available", c.available},
                              {"amx", c.amx},
                              {"self_check", c.self_check},
                              {"fallbacks", c.fallbacks},
                              {"flash_attn_tiled_rows", c.flash_attn_tiled_rows}});
          },
          "The CPU kernels this process runs, after the start-up self-check: variant (a portable build's "
          "libggml-cpu-<variant>.so, or 'built in'), library, features (instruction sets compiled in), "
          "available (the variants shipped), amx (AMX kernels in use), self_check (one line), fallbacks "
          "(each failed probe and what runs instead), flash_attn_tiled_rows (steps of this many query rows or more "
          "take patch 0010's flash-attention kernel; 0: upstream's kernels).");
    m.def("devices", [] {
              std::vector<device_info> found;
              {
                  py::gil_scoped_release release;  // loading a GPU module initialises its driver
                  found = shard_devices();
              }
              py::list out;
              for (const device_info & d : found) {
                  out.append(to_dict({{"name", d.name},
                                      {"description", d.description},
                                      {"backend", d.backend},
                                      {"type", d.type},
                                      {"memory_free", d.memory_free},
                                      {"memory_total", d.memory_total}}));
              }
              return out;
          },
          "The GPU devices ggml lists (ggml's names, e.g. 'Vulkan0'), each with its description, backend, "
          "type ('gpu' or 'igpu') and memory (free, total bytes). Loads the GPU modules this build ships "
          "where their driver's loader exists.");
    m.def("gpu_backends", [] {
              py::gil_scoped_release release;
              return shard_gpu_backends();
          },
          "One line per GPU module this build ships: loaded (with its device count) or why not.");
    m.attr("CPU_DEVICE") = CPU_DEVICE;
    m.def("is_cpu_device", &is_cpu_device, py::arg("name"),
          "Whether a device name is the CPU (any case): the one test of it.");
}

} // namespace llama_shard::bindings
