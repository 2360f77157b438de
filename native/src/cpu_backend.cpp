#include "llama_shard/cpu_backend.h"
#include "llama_shard/shard_error.h"
#include "backend_probe.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <sstream>
#include <thread>

namespace llama_shard {

namespace fs = std::filesystem;

static const char * const VARIANT_PREFIX = "libggml-cpu-";
static const char * const SET_AMX_ENABLED = "ggml_backend_cpu_set_amx_enabled";  // patch 0006
typedef void (*set_amx_enabled_t)(bool);
static const char * const SET_FLASH_ATTN_TILED_ROWS = "ggml_backend_cpu_set_flash_attn_tiled_min_rows";  // patch 0010
typedef void (*set_flash_attn_tiled_rows_t)(int);
static const char * const FLASH_ATTN_TILED_ROWS_ENV = "LLAMA_SHARD_FLASH_ATTN_TILED_ROWS";

// what the self-check found, filled once by shard_load_cpu_backend()
struct self_check_state {
    std::vector<std::string> fallbacks;
    std::string              summary;
    bool                     amx = false;
    int                      flash_attn_tiled_rows = 0;
};
static self_check_state g_check;

// ---------------------------------------------------------------------------------------------
// llama.cpp process state
// ---------------------------------------------------------------------------------------------

static thread_local std::string g_last_error;

static void shard_log_callback(ggml_log_level level, const char * text, void * /*user_data*/) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        std::string line(text);
        while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) {
            line.pop_back();
        }
        // every error line since the last clear: llama.cpp says why first ("error loading model:
        // ... has wrong shape") and that it failed last
        if (!line.empty() && g_last_error.size() < 4096) {
            g_last_error += (g_last_error.empty() ? "" : "; ") + line;
        }
    }
    // llama.cpp is chatty at info level; LLAMA_SHARD_LOG=1 shows everything, otherwise only errors
    static const bool verbose = [] {
        const char * v = std::getenv("LLAMA_SHARD_LOG");
        return v != nullptr && std::strcmp(v, "0") != 0;
    }();
    if (verbose || level == GGML_LOG_LEVEL_ERROR) {
        std::fputs(text, stderr);
    }
}

void shard_backend_init() {
    static std::once_flag once;
    std::call_once(once, [] {
        llama_log_set(shard_log_callback, nullptr);
        llama_backend_init();
    });
}

std::string shard_last_llama_error() {
    return g_last_error;
}

void shard_clear_llama_error() {
    g_last_error.clear();
}

// the file a function of this process comes from
static std::string library_of(const void * fn) {
    Dl_info info{};
    return fn != nullptr && dladdr(fn, &info) != 0 && info.dli_fname != nullptr ? info.dli_fname : "";
}

std::string shard_backend_dir() {
#ifdef GGML_BACKEND_DL
    return fs::path(library_of(reinterpret_cast<const void *>(&ggml_backend_load_all_from_path))).parent_path().string();
#else
    return "";
#endif
}

// ---------------------------------------------------------------------------------------------
// the probe: one quantized matrix product through the kernels, in a child process
// ---------------------------------------------------------------------------------------------

struct probe_spec {
    std::string name;         // what LLAMA_SHARD_CPU_PROBE_FAIL matches: a variant, "built-in" or "amx"
    std::string load_path;    // a portable variant to load in the child; empty: the registered CPU backend
    bool        amx = false;  // weights in the AMX buffer type (its tile kernels), else plain CPU buffers
};

static bool probe_forced_to_fail(const std::string & name) {
    const char * list = std::getenv("LLAMA_SHARD_CPU_PROBE_FAIL");
    std::stringstream names(list != nullptr ? list : "");
    for (std::string item; std::getline(names, item, ',');) {
        if (item == name) {
            return true;
        }
    }
    return false;
}

static uint32_t probe_random(uint32_t & state) {  // a fixed LCG: the same numbers on every machine
    state = state * 1664525u + 1013904223u;
    return state >> 8;
}

// K x N weights in Q4_0 times K x M activations, M = 32 (the AMX tile path, a GPU's batched kernel)
// and M = 1 (the single-row path), on `threads` threads where the backend has them; the result
// against a double-precision product of the same dequantised weights. Both sides quantise nothing
// else but the activations (a CPU to Q8_0), so the tolerance is a few per cent of the largest
// output: wrong kernels are off by far more.
int backend_probe_product(ggml_backend_dev_t dev, ggml_backend_buffer_type_t weight_buft, int threads, double * error) {
    constexpr int K = 256, N = 64, M = 32;
    ggml_backend_t backend = dev != nullptr ? ggml_backend_dev_init(dev, nullptr) : nullptr;
    if (backend == nullptr) {
        return PROBE_SETUP;
    }
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    if (auto set_threads = reinterpret_cast<ggml_backend_set_n_threads_t>(
            ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads"))) {
        set_threads(backend, threads);
    }
    if (weight_buft == nullptr) {
        weight_buft = ggml_backend_dev_buffer_type(dev);
    }

    const size_t meta = 8 * ggml_tensor_overhead() + ggml_graph_overhead();
    ggml_context * wctx = ggml_init({meta, nullptr, true});
    ggml_context * ctx  = ggml_init({meta, nullptr, true});
    ggml_tensor * w  = ggml_new_tensor_2d(wctx, GGML_TYPE_Q4_0, K, N);
    ggml_tensor * x  = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, M);
    ggml_tensor * x1 = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, 1);
    ggml_tensor * y  = ggml_mul_mat(ctx, w, x);
    ggml_tensor * y1 = ggml_mul_mat(ctx, w, x1);
    ggml_cgraph * graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, y);
    ggml_build_forward_expand(graph, y1);
    ggml_backend_buffer_t wbuf = ggml_backend_alloc_ctx_tensors_from_buft(wctx, weight_buft);
    ggml_backend_buffer_t buf  = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_dev_buffer_type(dev));
    auto release = [&](int rc) {  // a device's probe runs in the worker's own process: free all of it
        if (buf != nullptr) { ggml_backend_buffer_free(buf); }
        if (wbuf != nullptr) { ggml_backend_buffer_free(wbuf); }
        ggml_free(ctx);
        ggml_free(wctx);
        ggml_backend_free(backend);
        return rc;
    };
    if (wbuf == nullptr || buf == nullptr) {
        return release(PROBE_SETUP);
    }

    uint32_t seed = 12345;
    std::vector<float> wf(size_t(K) * N), xf(size_t(K) * M);
    for (float & v : wf) { v = float(probe_random(seed) % 2001) / 1000.0f - 1.0f; }
    for (float & v : xf) { v = float(probe_random(seed) % 2001) / 1000.0f - 1.0f; }
    std::vector<uint8_t> wq(ggml_row_size(GGML_TYPE_Q4_0, K) * N);
    ggml_quantize_chunk(GGML_TYPE_Q4_0, wf.data(), wq.data(), 0, N, K, nullptr);
    ggml_get_type_traits(GGML_TYPE_Q4_0)->to_float(wq.data(), wf.data(), int64_t(K) * N);  // what the kernels see
    ggml_backend_tensor_set(w, wq.data(), 0, wq.size());
    ggml_backend_tensor_set(x, xf.data(), 0, xf.size() * sizeof(float));
    ggml_backend_tensor_set(x1, xf.data(), 0, size_t(K) * sizeof(float));
    if (ggml_backend_graph_compute(backend, graph) != GGML_STATUS_SUCCESS) {
        return release(PROBE_SETUP);
    }

    std::vector<float> out(size_t(N) * M), out1(N);
    ggml_backend_tensor_get(y, out.data(), 0, out.size() * sizeof(float));
    ggml_backend_tensor_get(y1, out1.data(), 0, out1.size() * sizeof(float));
    double worst = 0.0, largest = 0.0;
    for (int m = 0; m < M; ++m) {
        for (int n = 0; n < N; ++n) {
            double ref = 0.0;
            for (int k = 0; k < K; ++k) {
                ref += double(wf[size_t(n) * K + k]) * double(xf[size_t(m) * K + k]);
            }
            largest = std::max(largest, std::fabs(ref));
            worst = std::max(worst, std::fabs(ref - double(out[size_t(m) * N + n])));
            if (m == 0) {
                worst = std::max(worst, std::fabs(ref - double(out1[n])));
            }
        }
    }
    if (error != nullptr) {
        *error = largest > 0.0 ? worst / largest : worst;
    }
    return release(std::isfinite(worst) && worst <= 0.03 * largest + 1e-3 ? PROBE_PASSED : PROBE_WRONG);
}

static int probe_compute(ggml_backend_reg_t reg, bool amx) {
    constexpr int THREADS = 4;
    ggml_backend_dev_t dev = ggml_backend_reg_dev_count(reg) > 0 ? ggml_backend_reg_dev_get(reg, 0) : nullptr;
    if (dev == nullptr) {
        return PROBE_SETUP;
    }
    ggml_backend_buffer_type_t weight_buft = nullptr;  // the device's own
    if (amx) {
        auto extra = reinterpret_cast<ggml_backend_dev_get_extra_bufts_t>(
            ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts"));
        for (ggml_backend_buffer_type_t * b = extra != nullptr ? extra(dev) : nullptr; b != nullptr && *b != nullptr; ++b) {
            if (std::strcmp(ggml_backend_buft_name(*b), "AMX") == 0) {
                weight_buft = *b;
            }
        }
        if (weight_buft == nullptr) {
            return PROBE_NO_AMX_BUFT;
        }
    }
    return backend_probe_product(dev, weight_buft, THREADS, nullptr);
}

[[noreturn]] static void probe_child(const probe_spec & spec) {
    // a fault must kill the child by its signal, silently: drop handlers it inherited (Python's
    // faulthandler would print a "fatal error" for a probe that merely failed)
    for (int sig : {SIGILL, SIGSEGV, SIGBUS, SIGFPE, SIGABRT}) {
        signal(sig, SIG_DFL);
    }
    const char * verbose = std::getenv("LLAMA_SHARD_LOG");
    if (verbose == nullptr || std::strcmp(verbose, "0") == 0) {
        const int null_fd = open("/dev/null", O_WRONLY);
        if (null_fd >= 0) {
            dup2(null_fd, STDOUT_FILENO);
            dup2(null_fd, STDERR_FILENO);
        }
    }
    if (probe_forced_to_fail(spec.name)) {
        raise(SIGILL);  // as a faulting instruction would
    }
    ggml_backend_reg_t reg = spec.load_path.empty() ? ggml_backend_reg_by_name("CPU")
                                                    : ggml_backend_load(spec.load_path.c_str());
    _exit(reg == nullptr ? PROBE_NO_BACKEND : probe_compute(reg, spec.amx));
}

// "SIGILL (Illegal instruction)" (sigabbrev_np needs glibc 2.32: the wheel may be built on older)
static std::string signal_name(int sig) {
    static const std::pair<int, const char *> names[] = {
        {SIGILL, "SIGILL"}, {SIGSEGV, "SIGSEGV"}, {SIGBUS, "SIGBUS"}, {SIGFPE, "SIGFPE"}, {SIGABRT, "SIGABRT"},
        {SIGKILL, "SIGKILL"}, {SIGTERM, "SIGTERM"}, {SIGSYS, "SIGSYS"}};
    std::string name = "signal " + std::to_string(sig);
    for (const auto & [number, text] : names) {
        if (number == sig) {
            name = text;
        }
    }
    return name + " (" + strsignal(sig) + ")";
}

// runs the probe; "" when it passed, else why it failed ("killed by SIGILL (Illegal instruction)")
static std::string run_probe(const probe_spec & spec) {
    std::fflush(nullptr);  // the child must not flush the parent's buffered output again
    const pid_t pid = fork();
    if (pid < 0) {
        return std::string("could not start a probe process: ") + std::strerror(errno);
    }
    if (pid == 0) {
        probe_child(spec);
    }
    int status = 0;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    pid_t done = 0;
    while ((done = waitpid(pid, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    if (done == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        return "hung for 60 s";
    }
    if (done < 0) {
        return std::string("lost its probe process: ") + std::strerror(errno);
    }
    if (WIFSIGNALED(status)) {
        return "killed by " + signal_name(WTERMSIG(status));
    }
    switch (WEXITSTATUS(status)) {
        case PROBE_PASSED:      return "";
        case PROBE_WRONG:       return "computed wrong results";
        case PROBE_NO_BACKEND:  return "ggml would not load it on this CPU";
        case PROBE_NO_AMX_BUFT: return "no AMX buffer: the kernel refused the tile data";
        case PROBE_SETUP:       return "could not set up the product";
        default:                return "exited with status " + std::to_string(WEXITSTATUS(status));
    }
}

// ---------------------------------------------------------------------------------------------
// choosing the kernels
// ---------------------------------------------------------------------------------------------

static void report_fallback(const std::string & line) {
    g_check.fallbacks.push_back(line);
    std::fprintf(stderr, "llama-shard: CPU self-check: %s\n", line.c_str());
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
    return shard_backend_dir();
}

static fs::path variant_path(const fs::path & dir, const std::string & variant) {
    return dir / (std::string(VARIANT_PREFIX) + variant + ".so");
}

// ggml's own score for a variant on this CPU (0: it cannot run here), read as ggml does
static int variant_score(const fs::path & path) {
    void * handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
        return 0;
    }
    auto score = reinterpret_cast<int (*)()>(dlsym(handle, "ggml_backend_score"));
    const int s = score != nullptr ? score() : 0;
    dlclose(handle);
    return s;
}

static void load_checked_dynamic_backend() {
    const fs::path dir = backend_dir();
    std::string names;
    for (const std::string & v : variants_in(dir)) {
        names += (names.empty() ? "" : ", ") + v;
    }
    const char * wanted = std::getenv("LLAMA_SHARD_CPU_VARIANT");
    if (wanted != nullptr && *wanted != '\0') {
        const fs::path path = variant_path(dir, wanted);
        const std::string what = std::string("LLAMA_SHARD_CPU_VARIANT=") + wanted;
        if (!fs::exists(path)) {
            throw shard_error(SHARD_ERRC_MODEL_LOAD, what + ": no such CPU variant in " + dir.string() + " (there: " + names + ")");
        }
        if (variant_score(path) == 0) {
            throw shard_error(SHARD_ERRC_MODEL_LOAD, what + ": this CPU cannot run that variant (there: " + names + ")");
        }
        const std::string failed = run_probe({wanted, path.string(), false});
        if (!failed.empty()) {
            throw shard_error(SHARD_ERRC_MODEL_LOAD, what + ": its kernels failed the self-check on this CPU (" + failed + ")");
        }
        ggml_backend_load(path.c_str());
    } else {
        std::vector<std::pair<int, std::string>> ranked;  // best score first, as ggml would choose
        for (const std::string & v : variants_in(dir)) {
            if (const int s = variant_score(variant_path(dir, v)); s > 0) {
                ranked.emplace_back(s, v);
            }
        }
        std::sort(ranked.begin(), ranked.end(), [](const auto & a, const auto & b) { return a.first > b.first; });
        for (size_t i = 0; i < ranked.size(); ++i) {
            const std::string & v = ranked[i].second;
            const std::string failed = run_probe({v, variant_path(dir, v).string(), false});
            if (failed.empty()) {
                ggml_backend_load(variant_path(dir, v).c_str());
                break;
            }
            report_fallback("the " + v + " kernels failed a probe (" + failed + "); trying " +
                            (i + 1 < ranked.size() ? "the " + ranked[i + 1].second + " kernels" : "nothing else"));
        }
    }
    if (ggml_backend_reg_by_name("CPU") == nullptr) {
        throw shard_error(SHARD_ERRC_MODEL_LOAD, "no CPU variant in " + dir.string() + " passes the self-check on this CPU (there: " + names + ")");
    }
}
#endif

// The fewest query rows of one step that take patch 0010's flash-attention kernel (0: upstream's
// kernels): fewer take upstream's one-row kernel. The kernel changes a row's rounding, so the value
// is part of a route's numerics (HotKvStateConfig.numerics); LLAMA_SHARD_FLASH_ATTN_TILED_ROWS
// overrides it for a study (benchmarks/flash_attn_study.py, attention_rows_study.py).
static void set_flash_attn_tiled_rows(ggml_backend_reg_t reg) {
    int rows = DEFAULT_FLASH_ATTN_TILED_ROWS;
    if (const char * env = std::getenv(FLASH_ATTN_TILED_ROWS_ENV); env != nullptr && *env != '\0') {
        char * end = nullptr;
        const long v = std::strtol(env, &end, 10);
        if (*end != '\0' || v < 0 || v > 4096) {
            throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, std::string(FLASH_ATTN_TILED_ROWS_ENV) + "=" + env +
                                                              " is not a row count from 0 (upstream's kernels) to 4096");
        }
        rows = static_cast<int>(v);
    }
    auto set = reinterpret_cast<set_flash_attn_tiled_rows_t>(ggml_backend_reg_get_proc_address(reg, SET_FLASH_ATTN_TILED_ROWS));
    if (set == nullptr) {
        throw shard_error(SHARD_ERRC_MODEL_LOAD, std::string("the CPU kernels lack ") + SET_FLASH_ATTN_TILED_ROWS +
                                                     " (llama.cpp without patch 0010)");
    }
    set(rows);
    g_check.flash_attn_tiled_rows = rows;
}

static void load_checked_cpu_backend() {
#ifdef GGML_BACKEND_DL
    load_checked_dynamic_backend();
#else
    const std::string failed = run_probe({"built-in", "", false});
    if (!failed.empty()) {
        throw shard_error(SHARD_ERRC_MODEL_LOAD,
                          "the CPU kernels built into this module fail on this CPU (" + failed +
                          "): rebuild it on this machine (bash scripts/install.sh) or install the portable wheel");
    }
#endif
    ggml_backend_reg_t reg = ggml_backend_reg_by_name("CPU");
    auto set_amx = reinterpret_cast<set_amx_enabled_t>(ggml_backend_reg_get_proc_address(reg, SET_AMX_ENABLED));
    if (set_amx != nullptr) {  // these kernels carry AMX: prove the tiles work on compute threads
        const std::string failed = run_probe({"amx", "", true});
        g_check.amx = failed.empty();
        if (!failed.empty()) {
            set_amx(false);
            report_fallback("AMX tiles failed a probe (" + failed + "); running the same kernels without AMX (AVX-512)");
        }
    }
    set_flash_attn_tiled_rows(reg);
    g_check.summary = g_check.fallbacks.empty() ? std::string("passed") + (g_check.amx ? " (AMX tiles included)" : "")
                                                : "fell back: " + g_check.fallbacks.back();
}

void shard_load_cpu_backend() {
    shard_backend_init();  // llama.cpp's log goes through ours first (ggml logs each library it loads)
    static std::once_flag once;
    std::call_once(once, load_checked_cpu_backend);  // a throw leaves the flag unset: the next call retries
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
    out.amx = g_check.amx;
    out.self_check = g_check.summary;
    out.fallbacks = g_check.fallbacks;
    out.flash_attn_tiled_rows = g_check.flash_attn_tiled_rows;
    return out;
}

}  // namespace llama_shard
