#include "llama_shard/cpu_backend.h"
#include "llama_shard/shard_error.h"
#include "llama_shard/shard_model.h"

#include "ggml-backend.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <mutex>

namespace llama_shard {

namespace fs = std::filesystem;

static const char * const VARIANT_PREFIX = "libggml-cpu-";

// the file a function of this process comes from
static std::string library_of(const void * fn) {
    Dl_info info{};
    return fn != nullptr && dladdr(fn, &info) != 0 && info.dli_fname != nullptr ? info.dli_fname : "";
}

#ifdef GGML_BACKEND_DL
// the variants next to libggml.so, by name (libggml-cpu-haswell.so -> haswell)
static std::vector<std::string> variants_in(const fs::path & dir) {
    std::vector<std::string> names;
    std::error_code ec;
    for (const auto & entry : fs::directory_iterator(dir, ec)) {
        const std::string file = entry.path().filename().string();
        if (file.rfind(VARIANT_PREFIX, 0) == 0 && entry.path().extension() == ".so") {
            names.push_back(file.substr(std::char_traits<char>::length(VARIANT_PREFIX),
                                        file.size() - std::char_traits<char>::length(VARIANT_PREFIX) - 3));
        }
    }
    std::sort(names.begin(), names.end());
    return names;
}

static fs::path backend_dir() {
    return fs::path(library_of(reinterpret_cast<const void *>(&ggml_backend_load_all_from_path))).parent_path();
}

static void load_dynamic_cpu_backend() {
    const fs::path dir = backend_dir();
    const char * wanted = std::getenv("LLAMA_SHARD_CPU_VARIANT");
    if (wanted != nullptr && *wanted != '\0') {
        const fs::path path = dir / (std::string(VARIANT_PREFIX) + wanted + ".so");
        std::string names;
        for (const std::string & v : variants_in(dir)) {
            names += (names.empty() ? "" : ", ") + v;
        }
        if (!fs::exists(path)) {
            throw shard_error(SHARD_ERRC_MODEL_LOAD, std::string("LLAMA_SHARD_CPU_VARIANT=") + wanted +
                              ": no such CPU variant in " + dir.string() + " (there: " + names + ")");
        }
        if (ggml_backend_load(path.c_str()) == nullptr) {  // ggml refuses a variant this CPU cannot run
            throw shard_error(SHARD_ERRC_MODEL_LOAD, std::string("LLAMA_SHARD_CPU_VARIANT=") + wanted +
                              ": this CPU cannot run that variant (there: " + names + ")");
        }
    } else {
        ggml_backend_load_all_from_path(dir.c_str());  // ggml's choice: the best score for this CPU
    }
    if (ggml_backend_reg_by_name("CPU") == nullptr) {
        throw shard_error(SHARD_ERRC_MODEL_LOAD, "no CPU backend could be loaded from " + dir.string());
    }
}
#endif

void shard_load_cpu_backend() {
    shard_backend_init();  // llama.cpp's log goes through ours first (ggml logs each library it loads)
#ifdef GGML_BACKEND_DL
    static std::once_flag once;
    std::call_once(once, load_dynamic_cpu_backend);  // a throw leaves the flag unset: the next call retries
#endif
}

cpu_backend_info shard_cpu_backend() {
    shard_load_cpu_backend();
    cpu_backend_info out;
    ggml_backend_reg_t reg = ggml_backend_reg_by_name("CPU");
    auto get_features = reg != nullptr ? reinterpret_cast<ggml_backend_get_features_t>(
                                             ggml_backend_reg_get_proc_address(reg, "ggml_backend_get_features"))
                                       : nullptr;
    if (get_features != nullptr) {
        for (const ggml_backend_feature * f = get_features(reg); f->name != nullptr; ++f) {
            if (std::string(f->value) == "1") {
                out.features.emplace_back(f->name);
            }
        }
    }
    out.library = library_of(reinterpret_cast<const void *>(get_features));
    const std::string file = fs::path(out.library).filename().string();
    const bool dynamic = file.rfind(VARIANT_PREFIX, 0) == 0;
    out.variant = dynamic ? file.substr(std::char_traits<char>::length(VARIANT_PREFIX),
                                        file.size() - std::char_traits<char>::length(VARIANT_PREFIX) - 3)
                          : "built in";
#ifdef GGML_BACKEND_DL
    out.available = variants_in(backend_dir());
#endif
    return out;
}

}  // namespace llama_shard
