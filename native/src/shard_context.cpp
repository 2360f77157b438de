#include "llama_shard/shard_context.h"
#include "shard_context_internal.h"

#include "llama-ext.h"  // llama_get_memory_breakdown (the pin's staging API)
#include "llama_shard/cpu_backend.h"

#include "llama.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

namespace llama_shard {

// ggml's polling level (0-100) for the context's own compute threads between steps (see the constructor)
static constexpr uint32_t COMPUTE_POOL_POLL = 1;

// ggml-cpu's thread-pool functions, from the module that computes: llama.cpp's CPU backend is the
// first device of type CPU. A portable build loads that module at run time; its registry hands out
// ggml_threadpool_new and _free but not _pause, taken from the same file (pause stays null if it
// cannot be found: the pool then works, without taking turns).
struct cpu_pool_functions {
    ggml_threadpool * (*make)(ggml_threadpool_params *) = nullptr;
    void              (*pause)(ggml_threadpool *) = nullptr;
    void              (*release)(ggml_threadpool *) = nullptr;
};

static cpu_pool_functions cpu_pool_functions_of_this_process() {
    cpu_pool_functions f;
#ifdef GGML_BACKEND_DL
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_reg_t reg = dev == nullptr ? nullptr : ggml_backend_dev_backend_reg(dev);
    if (reg == nullptr) {
        return f;
    }
    f.make = reinterpret_cast<decltype(f.make)>(ggml_backend_reg_get_proc_address(reg, "ggml_threadpool_new"));
    f.release = reinterpret_cast<decltype(f.release)>(ggml_backend_reg_get_proc_address(reg, "ggml_threadpool_free"));
    Dl_info info{};
    if (f.make != nullptr && dladdr(reinterpret_cast<void *>(f.make), &info) != 0 && info.dli_fname != nullptr) {
        if (void * module = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD)) {  // already loaded: no new copy
            f.pause = reinterpret_cast<decltype(f.pause)>(dlsym(module, "ggml_threadpool_pause"));
            dlclose(module);  // drops the reference NOLOAD took; ggml keeps the module loaded
        }
    }
#else
    f.make  = &ggml_threadpool_new;
    f.pause = &ggml_threadpool_pause;
    f.release = &ggml_threadpool_free;
#endif
    return f;
}

// The process's contexts take turns at polling: the last one to compute is the only one whose
// threads may still spin. A context about to compute pauses that one's pool (its threads sleep at
// once, and ggml resumes a paused pool when it next computes), unless it is computing itself
// (a context may run on another thread: a pool is never paused inside a graph). Otherwise, where
// contexts take turns (a draft model's steps between the route model's), each one's threads spin
// for the next step while the other computes, on the cores it computes on.
static std::mutex & compute_turns_mutex() {  // never destroyed: a context may outlive static destructors
    static std::mutex * mutex = new std::mutex;
    return *mutex;
}
static shard_context * last_to_compute = nullptr;  // guarded by compute_turns_mutex()

void shard_context::take_compute_turn() {
    std::lock_guard<std::mutex> lock(compute_turns_mutex());
    shard_context * last = last_to_compute;
    if (last != nullptr && last != this && !last->computing_ && last->threadpool_ != nullptr &&
            last->pool_pause_ != nullptr) {
        last->pool_pause_(last->threadpool_);
    }
    last_to_compute = this;
    computing_ = true;
}

void shard_context::end_compute_turn() {
    std::lock_guard<std::mutex> lock(compute_turns_mutex());
    computing_ = false;
}

// the constructor's steps: the parameters' own bounds, before anything is asked of the model
static void check_context_params(const shard_context_params & params) {
    if (params.n_ctx < 1 || params.n_seq_max < 1 || params.n_batch < 1 || params.n_threads < 0) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "n_ctx, n_seq_max and n_batch must be >= 1 and n_threads >= 0");
    }
    if (params.n_seq_max > SHARD_MAX_SEQUENCES) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT,
                          "n_seq_max must be <= " + str(SHARD_MAX_SEQUENCES) + " (llama.cpp's sequence limit)");
    }
    if (params.n_batch > params.n_ctx) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "n_batch (" + str(params.n_batch) + ") must not exceed n_ctx (" + str(params.n_ctx) + ")");
    }
}

// one layer's K (and V) cache is one tensor of n_ctx cells; a device takes no tensor larger
// than its buffer limits (Vulkan: maxStorageBufferRange), and llama.cpp aborts when a cache
// it placed there is too large to run on: ask the device first, as ggml's scheduler will
static void check_cache_fits(ggml_backend_dev_t device, const shard_model_info & info, ggml_type type, int32_t n_ctx) {
    ggml_init_params ip = {2 * ggml_tensor_overhead(), nullptr, /*no_alloc =*/ true};
    ggml_context * probe = ggml_init(ip);
    const int64_t row = (int64_t) info.n_head_kv * info.head_dim;
    ggml_tensor * cache = ggml_new_tensor_2d(probe, type, row, n_ctx);
    const size_t bytes = ggml_nbytes(cache);
    const bool fits = ggml_backend_dev_supports_op(device, cache);
    ggml_free(probe);
    if (!fits) {
        throw shard_error(SHARD_ERRC_CAPACITY,
            "one layer's K cache (" + str((int64_t) (bytes >> 20)) + " MiB: " + str(n_ctx) + " cells) is larger than " +
            ggml_backend_dev_name(device) + " takes in one tensor: give fewer sessions or context tokens, or run on the CPU");
    }
}

// llama.cpp's parameters for this context, every setting that changes results explicit
static llama_context_params context_params(const shard_model & model, const shard_context_params & params,
                                           ggml_type type) {
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx           = (uint32_t) params.n_ctx;
    cparams.n_batch         = (uint32_t) params.n_batch;
    cparams.n_ubatch        = (uint32_t) params.n_batch;
    cparams.n_seq_max       = (uint32_t) params.n_seq_max;
    // llama.cpp reserves outputs for max(n_outputs, n_seq_max) and asserts that fits n_outputs_max
    // (default n_batch): more sequences than n_batch would abort at the first decode
    cparams.n_outputs_max   = (uint32_t) std::max(params.n_batch, params.n_seq_max);
    cparams.n_threads       = params.n_threads > 0 ? params.n_threads : model.n_threads();
    cparams.n_threads_batch = cparams.n_threads;
    cparams.kv_unified      = params.kv_unified;
    cparams.embeddings      = !model.info().is_tail;  // a non-tail shard returns the residual of every token
    cparams.pooling_type    = LLAMA_POOLING_TYPE_NONE;
    cparams.type_k          = type;
    cparams.type_v          = type;
    // explicit either way (llama.cpp's AUTO resolves to enabled on a CPU): the cache layout and the
    // logits' rounding follow this setting, so it must not depend on what llama.cpp detects
    cparams.flash_attn_type = params.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cparams.no_perf         = true;
    // a partial offload's CPU layers stay on the CPU for every batch (llama.cpp would move a large
    // batch's products to the GPU: results would then depend on the batch's size)
    cparams.op_offload      = false;
    cparams.swa_full        = params.swa_full;  // see shard_context_params
    return cparams;
}

// a model without experts (its GGUF names no expert_count, or 0)
static bool model_is_dense(const shard_model & model) {
    char experts[32] = {0};
    const std::string expert_key = model.info().architecture + ".expert_count";
    return llama_model_meta_val_str(model.raw(), expert_key.c_str(), experts, sizeof(experts)) < 0 ||
           std::atoi(experts) == 0;
}

// Compute threads of its own that outlive a step. Without one, ggml makes a thread pool for
// every graph and joins it after: each step starts n_threads - 1 new threads, which on a
// small machine wait behind the callers' threads for a core while the step's first
// barrier spins. That cost 8-12% of the adapter path's decode (4 and 8 threads through
// KvBoundaryAdapter, docs/benchmarks.md "Compute threads"). poll 1: after a step the threads
// spin ~131k rounds (milliseconds) for the next one, then sleep, and they sleep at once
// when another context of the process computes (take_compute_turn).
void shard_context::attach_threadpool(int32_t n_threads) {
    const cpu_pool_functions fns = cpu_pool_functions_of_this_process();
    pool_pause_ = fns.pause;
    pool_free_  = fns.release;
    auto pool_new = fns.make;
    if (pool_new != nullptr && pool_free_ != nullptr) {
        ggml_threadpool_params tpp = ggml_threadpool_params_default((int) n_threads);
        tpp.poll = COMPUTE_POOL_POLL;
        threadpool_ = pool_new(&tpp);
        if (threadpool_ != nullptr) {
            llama_attach_threadpool(ctx_, threadpool_, threadpool_);
        }
    }
}

shard_context::shard_context(const shard_model & model, const shard_context_params & params) : model_(model) {
    check_context_params(params);
    const shard_model_info & info = model.info();
    // validates the type first
    llama_shard::kv_bytes_per_token(info.n_head_kv, info.head_dim, info.n_owned_layers(), params.kv_type);
    kv_type_ = params.kv_type;
    const ggml_type type = kv_ggml_type(params.kv_type);
    // what the cache allocates per token (per-layer head sizes, latent attention's K-only rows)
    kv_bytes_per_token_ = llama_model_kv_bytes_per_token(model.raw(), type, type);
    if (!params.flash_attn && type != GGML_TYPE_F16) {
        // llama.cpp would abort context creation with a log line; say why here
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "kv_type " + params.kv_type + " needs flash attention (llama.cpp's quantized V cache)");
    }
    if (ggml_backend_dev_t device = model.device()) {
        check_cache_fits(device, info, type, params.n_ctx);
    }

    const llama_context_params cparams = context_params(model, params, type);
    shard_clear_llama_error();
    ctx_ = llama_init_from_model(model.raw(), cparams);
    if (ctx_ == nullptr) {
        const std::string why = shard_last_llama_error();
        throw shard_error(SHARD_ERRC_CAPACITY, "llama.cpp could not create the context" + (why.empty() ? std::string() : ": " + why));
    }
    if (cparams.n_threads > 1) {
        attach_threadpool(cparams.n_threads);
    }
    n_ctx_     = (int32_t) llama_n_ctx(ctx_);
    n_seq_max_ = (int32_t) llama_n_seq_max(ctx_);
    n_batch_   = (int32_t) llama_n_batch(ctx_);
    n_ctx_seq_ = (int32_t) llama_n_ctx_seq(ctx_);
    kv_unified_ = params.kv_unified;
    const llama_rope_type rope = llama_model_rope_type(model.raw());
    n_pos_per_embd_ = rope == LLAMA_ROPE_TYPE_MROPE || rope == LLAMA_ROPE_TYPE_IMROPE ? 4 : 1;  // GGML_MROPE_SECTIONS
    batch_     = std::make_unique<batch_buffers>(n_batch_, info.is_head ? 0 : info.n_embd, info.is_head ? 1 : n_pos_per_embd_);
    // One call can give a verification's rows the bytes of one-token steps only where attention
    // computes a row alike whatever the call's shape and wherever its cells sit: patch 0010's kernel
    // (the CPU, a float cache, every step). Then the comparison of whole_rows_verdict_ at one depth
    // holds at every depth. Every cell is kept (swa_full), so a compared call's cells can be cut.
    // Dense models only: a mixture of experts hands each expert rows by their values, so one
    // comparison would not prove another input's shapes; a recurrent state cannot be cut back.
    const bool dense = model_is_dense(model);
    recurrent_ = llama_model_is_recurrent(model.raw()) || llama_model_is_hybrid(model.raw());
    whole_rows_possible_ = params.flash_attn && type == GGML_TYPE_F16 && model.device() == nullptr &&
                           params.swa_full && shard_cpu_backend().flash_attn_tiled_rows == 1 && dense &&
                           !recurrent_;
}

shard_memory shard_context::memory() const {
    shard_memory m;
    m.device = model_.info().device;
    ggml_backend_dev_t device = nullptr;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        if (!is_cpu_device(m.device) && m.device == ggml_backend_dev_name(ggml_backend_dev_get(i))) {
            device = ggml_backend_dev_get(i);
        }
    }
    if (device != nullptr) {
        size_t free_b = 0, total_b = 0;
        ggml_backend_dev_memory(device, &free_b, &total_b);
        m.device_free  = free_b;
        m.device_total = total_b;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto & [buft, mb] : llama_get_memory_breakdown(ctx_)) {
        // a GPU backend's pinned host buffers name the GPU as their device: they are host memory
        if (device != nullptr && !ggml_backend_buft_is_host(buft) && ggml_backend_buft_get_device(buft) == device) {
            m.device_model += mb.model;
            m.device_context += mb.context;
            m.device_compute += mb.compute;
        } else {
            m.host_model += mb.model;
            m.host_context += mb.context;
            m.host_compute += mb.compute;
        }
    }
    return m;
}

shard_memory shard_plan_memory(const shard_model_params & model_params, const shard_context_params & params) {
    shard_model_params dry = model_params;
    dry.no_alloc = true;
    shard_model model(dry);
    shard_context ctx(model, params);
    return ctx.memory();
}

shard_context::~shard_context() {
    batch_.reset();
    if (ctx_ != nullptr) {
        llama_free(ctx_);
    }
    {
        std::lock_guard<std::mutex> lock(compute_turns_mutex());
        if (last_to_compute == this) {
            last_to_compute = nullptr;
        }
    }
    if (threadpool_ != nullptr) {  // after the context: it computes no more
        pool_free_(threadpool_);
    }
}

int64_t shard_context::output_size(int64_t n_tokens, int32_t n_logits) const {
    const shard_model_info & info = model_.info();
    return info.is_tail ? (int64_t) n_logits * info.n_vocab : n_tokens * info.n_embd;
}

// ---------------------------------------------------------------------------------------------
// validation: everything llama.cpp would abort on, or silently misread, is refused here
// ---------------------------------------------------------------------------------------------

void shard_context::validate_seq_id(int32_t seq_id) const {
    if (seq_id < 0 || seq_id >= n_seq_max_) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "seq_id " + str(seq_id) + " is outside [0, " + str(n_seq_max_) + ")");
    }
}

void shard_context::validate_input(const shard_input & input) const {
    const shard_model_info & info = model_.info();
    if ((input.tokens == nullptr) == (input.hidden == nullptr)) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "pass exactly one of tokens (head shard) or hidden (non-head shard)");
    }
    if (input.tokens != nullptr && !info.is_head) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT,
            "token ids sent to a non-head shard (owns layers " + str(info.first) + "-" + str(info.last) + "): send the previous shard's hidden state");
    }
    if (input.hidden != nullptr && info.is_head) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "hidden state sent to the head shard: send token ids");
    }
    if (input.n_tokens < 1) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "empty input: at least one token is required");
    }
    if (input.n_tokens > n_batch_) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT,
            "batch of " + str(input.n_tokens) + " tokens exceeds the context's n_batch " + str(n_batch_));
    }
    if (input.n_logits < 1 || input.n_logits > input.n_tokens || input.n_logits > HOT_KV_MAX_LOGIT_ROWS) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT,
            "a step returns logits of 1 to min(n_tokens, " + str(HOT_KV_MAX_LOGIT_ROWS) + ") tokens, got " +
            str(input.n_logits) + " of " + str(input.n_tokens));
    }
    if (input.tokens != nullptr) {
        for (int64_t i = 0; i < input.n_tokens; ++i) {
            const int32_t t = input.tokens[i];
            if (t < 0 || t >= info.n_vocab) {
                throw shard_error(SHARD_ERRC_INVALID_ARGUMENT,
                    "token id " + str(t) + " at index " + str(i) + " is outside the vocabulary [0, " + str(info.n_vocab) + ")");
            }
        }
    } else {
        if (input.hidden_cols != info.n_embd) {
            throw shard_error(SHARD_ERRC_INVALID_ARGUMENT,
                "hidden rows have " + str(input.hidden_cols) + " columns; this model's n_embd is " + str(info.n_embd));
        }
        const int64_t n = input.n_tokens * info.n_embd;
        for (int64_t i = 0; i < n; ++i) {
            if (!std::isfinite(input.hidden[i])) {
                throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "hidden state contains a non-finite value at flat index " + str(i));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// the sequences' cells and states (compute: shard_context_forward.cpp)
// ---------------------------------------------------------------------------------------------

bool shard_context::seq_rm(int32_t seq_id, int32_t p0) {
    std::lock_guard<std::mutex> lock(mutex_);
    validate_seq_id(seq_id);
    if (p0 < 0) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "p0 must be >= 0");
    }
    return llama_memory_seq_rm(llama_get_memory(ctx_), seq_id, p0, -1);
}

int32_t shard_context::seq_pos_max(int32_t seq_id) const {
    std::lock_guard<std::mutex> lock(mutex_);
    validate_seq_id(seq_id);
    return llama_memory_seq_pos_max(llama_get_memory(ctx_), seq_id);
}

int32_t shard_context::seq_pos_min(int32_t seq_id) const {
    std::lock_guard<std::mutex> lock(mutex_);
    validate_seq_id(seq_id);
    if (recurrent_) {  // llama.cpp answers the recurrent state's position (the last): the cells start at 0
        return llama_memory_seq_pos_max(llama_get_memory(ctx_), seq_id) >= 0 ? 0 : -1;
    }
    return llama_memory_seq_pos_min(llama_get_memory(ctx_), seq_id);
}

int64_t shard_context::n_cells_used() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return n_cells_used_unlocked();
}

size_t shard_context::seq_state_size(int32_t seq_id) const {
    std::lock_guard<std::mutex> lock(mutex_);
    validate_seq_id(seq_id);
    return llama_state_seq_get_size(ctx_, seq_id);
}

bool shard_context::seq_save(int32_t seq_id, uint8_t * dst, size_t size) const {
    std::lock_guard<std::mutex> lock(mutex_);
    validate_seq_id(seq_id);
    if (dst == nullptr || size == 0 || llama_state_seq_get_size(ctx_, seq_id) != size) {
        return false;
    }
    return llama_state_seq_get_data(ctx_, dst, size, seq_id) == size;
}

bool shard_context::seq_restore(int32_t seq_id, const uint8_t * data, size_t size) {
    std::lock_guard<std::mutex> lock(mutex_);
    validate_seq_id(seq_id);
    if (data == nullptr || size == 0) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "no sequence state to restore");
    }
    if (llama_state_seq_set_data(ctx_, data, size, seq_id) != size) {
        llama_memory_seq_rm(llama_get_memory(ctx_), seq_id, -1, -1);  // nothing half-restored stays
        return false;
    }
    return true;
}

bool shard_context::seq_save_recurrent(int32_t seq_id, page_buffer & out) const {
    std::lock_guard<std::mutex> lock(mutex_);
    validate_seq_id(seq_id);
    const size_t size = llama_state_seq_get_size_ext(ctx_, seq_id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
    out = size > 0 ? page_buffer::allocate(size) : page_buffer{};
    return !out.empty() &&
           llama_state_seq_get_data_ext(ctx_, out.data(), size, seq_id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) == size;
}

bool shard_context::seq_restore_recurrent(int32_t seq_id, const page_buffer & state) {
    std::lock_guard<std::mutex> lock(mutex_);
    validate_seq_id(seq_id);
    return !state.empty() && llama_state_seq_set_data_ext(ctx_, state.data(), state.size(), seq_id,
                                                          LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) == state.size();
}

// cells in use = the sum over sequences of their lengths (positions are contiguous from 0)
int64_t shard_context::n_cells_used_unlocked() const {
    llama_memory_t mem = llama_get_memory(ctx_);
    int64_t total = 0;
    for (int32_t s = 0; s < n_seq_max_; ++s) {
        // a recurrent memory's first position is its last (the state): the attention cells start at 0
        const llama_pos lo = recurrent_ ? (llama_memory_seq_pos_max(mem, s) >= 0 ? 0 : -1) : llama_memory_seq_pos_min(mem, s);
        const llama_pos hi = llama_memory_seq_pos_max(mem, s);
        if (lo >= 0 && hi >= lo) {
            total += hi - lo + 1;
        }
    }
    return total;
}

} // namespace llama_shard
