#include "llama_shard/devices.h"
#include "llama_shard/cpu_backend.h"
#include "llama_shard/shard_error.h"
#include "backend_probe.h"

#include "ggml-backend.h"

#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>

namespace llama_shard {

namespace fs = std::filesystem;

namespace {

struct gpu_module {
    const char * backend;  // ggml's registry name
    const char * file;     // the module next to libggml.so
    const char * loader;   // the driver's library it links: no loader, no module
};

// the order ggml's releases use to prefer one backend's devices over another's
const gpu_module GPU_MODULES[] = {
    {"CUDA",   "libggml-cuda.so",   "libcuda.so.1"},
    {"Vulkan", "libggml-vulkan.so", "libvulkan.so.1"},
};

std::mutex               g_mutex;
std::vector<std::string> g_backends;            // one line per shipped module
std::map<ggml_backend_dev_t, std::string> g_checked;  // each device's self-check line
std::map<ggml_backend_dev_t, bool>        g_passed;

std::string lower(std::string s) {
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return (char) std::tolower(c); });
    return s;
}

bool library_present(const char * soname) {
    void * handle = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
        return false;
    }
    dlclose(handle);
    return true;
}

void load_gpu_modules_locked() {
    static bool loaded = false;
    if (loaded) {
        return;
    }
    loaded = true;
    shard_load_cpu_backend();  // the CPU first: a GPU backend's host buffers and fallbacks use it
    const std::string dir = shard_backend_dir();
    if (dir.empty()) {
        return;  // a static build has no modules
    }
    // LLAMA_SHARD_GPU_BACKENDS=vulkan,cuda|none: the modules that may load (default: every one shipped)
    const char * allowed_env = std::getenv("LLAMA_SHARD_GPU_BACKENDS");
    const std::string allowed = allowed_env != nullptr ? lower(allowed_env) : "";
    for (const gpu_module & m : GPU_MODULES) {
        const fs::path path = fs::path(dir) / m.file;
        if (!fs::exists(path)) {
            continue;  // not built into this install
        }
        if (allowed_env != nullptr && ("," + allowed + ",").find("," + lower(m.backend) + ",") == std::string::npos) {
            g_backends.push_back(std::string(m.backend) + ": not loaded: LLAMA_SHARD_GPU_BACKENDS=" + allowed_env);
            continue;
        }
        if (!library_present(m.loader)) {
            g_backends.push_back(std::string(m.backend) + ": not loaded: no " + m.backend + " driver loader (" + m.loader + ")");
            continue;
        }
        shard_clear_llama_error();
        ggml_backend_reg_t reg = ggml_backend_load(path.c_str());
        if (reg == nullptr) {
            const std::string why = shard_last_llama_error();
            g_backends.push_back(std::string(m.backend) + ": not loaded: " + (why.empty() ? "ggml refused " + path.string() : why));
            continue;
        }
        g_backends.push_back(std::string(m.backend) + ": loaded, " + std::to_string(ggml_backend_reg_dev_count(reg)) + " device(s)");
    }
}

// the modules' lines in one ("Vulkan: loaded, 1 device(s); CUDA: not loaded: ..."); "" for none
std::string backends_line() {
    std::string out;
    for (const std::string & b : g_backends) {
        out += (out.empty() ? "" : "; ") + b;
    }
    return out;
}

bool is_gpu(ggml_backend_dev_t dev) {
    const auto type = ggml_backend_dev_type(dev);
    return type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU;
}

std::vector<ggml_backend_dev_t> gpu_devices() {
    std::vector<ggml_backend_dev_t> out;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        if (is_gpu(dev)) {
            out.push_back(dev);
        }
    }
    return out;
}

// LLAMA_SHARD_DEVICE_PROBE_FAIL=name[,name...]: the named devices' self-checks fail as wrong results
// would (an operator keeps a device out of `auto`; tests drive the fallback on any machine)
bool device_probe_forced_to_fail(const std::string & name) {
    const char * list = std::getenv("LLAMA_SHARD_DEVICE_PROBE_FAIL");
    const std::string names = "," + lower(list != nullptr ? list : "") + ",";
    return names.find("," + lower(name) + ",") != std::string::npos;
}

std::string self_check_locked(ggml_backend_dev_t dev, bool * passed) {
    auto it = g_checked.find(dev);
    if (it == g_checked.end()) {
        double error = 0.0;
        int rc = backend_probe_product(dev, nullptr, 1, &error);
        if (device_probe_forced_to_fail(ggml_backend_dev_name(dev))) {
            rc = PROBE_WRONG;
            error = 1.0;
        }
        char line[160];
        if (rc == PROBE_PASSED) {
            std::snprintf(line, sizeof(line), "passed (a Q4_0 product within %.1e of the largest output)", error);
        } else if (rc == PROBE_WRONG) {
            std::snprintf(line, sizeof(line), "failed: a Q4_0 product was off by %.1e of the largest output", error);
        } else {
            std::snprintf(line, sizeof(line), "failed: the device could not run a Q4_0 product (allocation or compute error)");
        }
        it = g_checked.emplace(dev, line).first;
        g_passed[dev] = rc == PROBE_PASSED;
    }
    if (passed != nullptr) {
        *passed = g_passed[dev];
    }
    return it->second;
}

}  // namespace

std::vector<std::string> shard_gpu_backends() {
    std::lock_guard<std::mutex> lock(g_mutex);
    load_gpu_modules_locked();
    return g_backends;
}

device_info shard_device_info(ggml_backend_dev_t dev) {
    device_info d;
    d.name        = ggml_backend_dev_name(dev);
    d.description = ggml_backend_dev_description(dev);
    d.backend     = ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev));
    d.type        = ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_IGPU ? "igpu" : "gpu";
    size_t free_b = 0, total_b = 0;
    ggml_backend_dev_memory(dev, &free_b, &total_b);
    d.memory_free  = free_b;
    d.memory_total = total_b;
    return d;
}

std::vector<device_info> shard_devices() {
    std::lock_guard<std::mutex> lock(g_mutex);
    load_gpu_modules_locked();
    std::vector<device_info> out;
    for (ggml_backend_dev_t dev : gpu_devices()) {
        out.push_back(shard_device_info(dev));
    }
    return out;
}

std::string shard_device_self_check(ggml_backend_dev_t dev, bool * passed) {
    std::lock_guard<std::mutex> lock(g_mutex);
    return self_check_locked(dev, passed);
}

bool is_cpu_device(const std::string & name) {
    return lower(name) == CPU_DEVICE;
}

ggml_backend_dev_t shard_choose_device(const std::string & wanted, std::string * why_cpu) {
    if (why_cpu != nullptr) {
        why_cpu->clear();
    }
    if (is_cpu_device(wanted)) {
        return nullptr;
    }
    const std::string name = lower(wanted);
    std::lock_guard<std::mutex> lock(g_mutex);
    load_gpu_modules_locked();
    const std::vector<ggml_backend_dev_t> devices = gpu_devices();
    if (name == "auto") {
        std::string reasons;
        for (ggml_backend_dev_t dev : devices) {
            bool passed = false;
            const std::string line = self_check_locked(dev, &passed);
            if (passed) {
                return dev;
            }
            reasons += (reasons.empty() ? "" : "; ") + std::string(ggml_backend_dev_name(dev)) + " self-check " + line;
            std::fprintf(stderr, "llama-shard: device self-check: %s %s; not used\n", ggml_backend_dev_name(dev), line.c_str());
        }
        if (why_cpu != nullptr) {
            const std::string backends = backends_line();
            *why_cpu = !reasons.empty() ? reasons
                     : "no GPU device listed" + (backends.empty() ? std::string(" (this build ships no GPU backend)") : " (" + backends + ")");
        }
        return nullptr;
    }
    std::string listed;
    for (ggml_backend_dev_t dev : devices) {
        if (lower(ggml_backend_dev_name(dev)) == name) {
            bool passed = false;
            const std::string line = self_check_locked(dev, &passed);
            if (!passed) {
                throw shard_error(SHARD_ERRC_MODEL_LOAD, "device " + std::string(ggml_backend_dev_name(dev)) + " (" +
                                  ggml_backend_dev_description(dev) + ") failed its self-check: " + line);
            }
            return dev;
        }
        listed += (listed.empty() ? "" : ", ") + std::string(ggml_backend_dev_name(dev));
    }
    const std::string backends = backends_line();
    throw shard_error(SHARD_ERRC_INVALID_ARGUMENT,
        "no device named '" + wanted + "' (devices: cpu, auto" + (listed.empty() ? "" : ", " + listed) + "; GPU backends: " +
        (backends.empty() ? "none in this build" : backends) + ")");
}

}  // namespace llama_shard
