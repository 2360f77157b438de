#pragma once

// shard_context's internals shared by its two source files (shard_context.cpp: construction,
// validation, the sequences' cells and states; shard_context_forward.cpp: compute). Not a public
// header: nothing outside shard_context includes it.

#include "llama_shard/shard_context.h"

#include "llama.h"

#include <cstdint>
#include <cstdlib>
#include <new>
#include <string>

namespace llama_shard {

// one llama_batch sized for n_batch tokens, reused by every call (no per-call allocation)
struct shard_context::batch_buffers {
    llama_batch batch{};

    // n_pos positions a token: an M-RoPE model's embeddings input (a non-head shard's residual)
    // carries one per rope section, section-major (llama_batch_free frees them as its own)
    batch_buffers(int32_t n_batch, int32_t n_embd_or_zero, int32_t n_pos) {
        batch = llama_batch_init(n_batch, n_embd_or_zero, 1);
        if (n_pos > 1) {
            std::free(batch.pos);
            batch.pos = (llama_pos *) std::malloc(sizeof(llama_pos) * (size_t) n_batch * (size_t) n_pos);
            if (batch.pos == nullptr) {
                llama_batch_free(batch);
                throw std::bad_alloc();
            }
        }
    }
    ~batch_buffers() { llama_batch_free(batch); }
};

inline std::string str(int64_t v) { return std::to_string(v); }

} // namespace llama_shard
