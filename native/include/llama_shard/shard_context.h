#pragma once

// shard_context: one bounded llama_context over a shard_model, holding several sequences.
//
// Invariants:
//  - kv_unified: n_ctx cells shared by all sequences; otherwise each of the n_seq_max sequences has
//    its own stream of n_ctx_seq cells, so its cells stay in position order whatever the other
//    sequences do, and its results do not depend on them to the bit (attention sums in cell order);
//  - at most n_batch tokens per forward call (more would trip a GGML_ASSERT in llama_decode, so it
//    is refused here);
//  - a sequence's positions are contiguous from 0: forward() must start exactly at the sequence's
//    next position (seq_pos_max + 1); to rewrite a suffix, seq_rm() it first;
//  - head shards take token ids, non-head shards take float32 hidden rows (n_tokens x n_embd);
//    non-tail shards return the unnormalized residual of every input token, the tail returns the
//    logits of the last n_logits input tokens (1 unless asked: a speculative verification);
//  - every check runs before llama.cpp is called; a rejected call changes nothing, and a failed
//    llama_decode has every position it added removed again before the error is thrown;
//  - a row_by_row input's rows are one-token steps' to the byte. They are computed in one call only
//    where that is proven for their count (whole_rows_verdicts): the first such input of each count
//    is computed both ways and compared, and only where attention is patch 0010's kernel, whose
//    rows do not depend on a call's shape nor on where cells sit (the matmuls' kernels still may:
//    that is what the comparison decides);
//  - llama_context is not thread-safe: every public method takes the context's mutex.

#include "llama_shard/hot_kv_limits.h"
#include "llama_shard/kv_type.h"
#include "llama_shard/page_buffer.h"
#include "llama_shard/shard_model.h"

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

struct llama_context;
struct ggml_threadpool;

namespace llama_shard {

// llama.cpp's limit on sequences in one context (LLAMA_MAX_SEQ): the most sessions a shard holds hot
constexpr int32_t SHARD_MAX_SEQUENCES = 256;

struct shard_context_params {
    int32_t n_ctx     = 4096;  // KV cells over all sequences
    int32_t n_seq_max = 4;     // sequences
    int32_t n_batch   = 512;   // most tokens in one forward call
    int32_t n_threads = 0;     // 0 = the model's thread count
    bool    kv_unified = true; // one pool of cells for all sequences, or one stream per sequence
    std::string kv_type = "f16"; // K and V element type: f16, q8_0 or q4_0 (the quantized ones need flash attention)
    bool    flash_attn = true;   // llama.cpp's flash attention; off: V is stored transposed (f16 only)
    // sliding-window layers (Gemma 3) keep every cell, not just the window, so that a truncation or a
    // continuation may reach any position a session holds and stays exact; false holds the window
    // only (less memory; the Hot KV engine always uses true)
    bool    swa_full = true;
};

// what one forward call consumes: exactly one of tokens / hidden
struct shard_input {
    const int32_t * tokens   = nullptr;  // n_tokens ids (head)
    const float *   hidden   = nullptr;  // n_tokens * n_embd floats, row-major (non-head)
    int64_t         n_tokens = 0;
    int64_t         hidden_cols = 0;     // the caller's row width, checked against n_embd
    // the tail: logits of the last n_logits tokens, in order (1..min(n_tokens, HOT_KV_MAX_LOGIT_ROWS));
    // other shards ignore it (they return every token's row)
    int32_t         n_logits = 1;
    // every row (hidden state, logits) the one a one-token step gives, to the bit: computed after the
    // step's other sequences, in one llama_decode call where that was shown to give those bytes
    // (whole_rows_verdicts), each token by its own call otherwise (llama.cpp's kernels may round by a
    // call's shape); a speculative verification that must give non-speculative tokens
    bool            row_by_row = false;
};

// the bytes a context and its model hold, as llama.cpp accounts them (llama_get_memory_breakdown):
// on the model's device (0 on the CPU) and in host memory
struct shard_memory {
    std::string device = CPU_DEVICE;   // the model's device
    uint64_t    device_free  = 0; // the device's free and total memory now (0 on the CPU)
    uint64_t    device_total = 0;
    uint64_t    device_model = 0, device_context = 0, device_compute = 0;  // weights, KV, compute buffers
    uint64_t    host_model = 0, host_context = 0, host_compute = 0;
    uint64_t device_bytes() const { return device_model + device_context + device_compute; }
};

// the memory a model and a context of these parameters would take, from a dry run (no buffer is
// allocated, no weight read); throws what the real load would for a bad path, range or device
shard_memory shard_plan_memory(const shard_model_params & model_params, const shard_context_params & params);

class shard_context {
public:
    shard_context(const shard_model & model, const shard_context_params & params);
    ~shard_context();

    shard_context(const shard_context &) = delete;
    shard_context & operator=(const shard_context &) = delete;

    const shard_model & model() const { return model_; }
    int32_t n_ctx()     const { return n_ctx_; }
    int32_t n_seq_max() const { return n_seq_max_; }
    int32_t n_batch()   const { return n_batch_; }
    int32_t n_ctx_seq() const { return n_ctx_seq_; }  // cells one sequence can hold
    bool    kv_unified() const { return kv_unified_; }
    // what this context and its model hold, by llama.cpp's account (sized, for a dry-run model)
    shard_memory memory() const;

    // floats forward() writes: n_tokens * n_embd (non-tail) or n_logits * n_vocab (tail)
    int64_t output_size(int64_t n_tokens, int32_t n_logits = 1) const;

    // runs the owned layers over `input` for `seq_id` starting at `pos`; writes output_size() floats to `out`
    void forward(int32_t seq_id, int32_t pos, const shard_input & input, float * out);

    // one item of a batched forward: a distinct sequence, its start position, input and output
    struct batch_item {
        int32_t     seq_id;
        int32_t     pos;
        shard_input input;
        float *     out;
    };

    // runs several sequences together, packing them into as few llama_decode calls as n_batch
    // allows (an item is never split). All items are validated first; if any llama_decode fails,
    // every position of every item is removed again before the error is thrown. Returns the
    // number of llama_decode calls made.
    // inputs_validated: the caller already ran validate_input on every item (it is not repeated;
    // sequence ids and positions are always checked)
    int32_t forward_batch(const std::vector<batch_item> & items, bool inputs_validated = false);

    // llama_decode calls made by this context so far
    uint64_t n_decode_calls() const;

    // row_by_row inputs of n tokens (2..HOT_KV_MAX_LOGIT_ROWS), by n, once the first was computed both
    // ways: "one call" (it gave the bytes of n one-token steps in less time: such inputs are one call
    // since), "row by row: one call was slower", "row by row: one call rounded differently". Empty
    // where it is never tried (see whole_rows_possible).
    std::map<int32_t, std::string> whole_rows_verdicts() const;
    // whether whole-call verification can be proven here: flash attention by patch 0010's kernel
    // on the CPU (an f16 cache, every step), every cell kept (swa_full)
    bool whole_rows_possible() const { return whole_rows_possible_; }

    // removes positions [p0, inf) of `seq_id`; returns false if llama.cpp refused (never for a valid id)
    bool seq_rm(int32_t seq_id, int32_t p0);

    // last position held for `seq_id`, -1 when empty
    int32_t seq_pos_max(int32_t seq_id) const;
    // first position held for `seq_id` (a sliding-window model: in its sliding-window layers), -1 when empty
    int32_t seq_pos_min(int32_t seq_id) const;

    // cells in use over all sequences
    int64_t n_cells_used() const;

    // --- one sequence's KV as bytes (llama.cpp's sequence state format), for the warm tier ---
    // the bytes seq_save writes for `seq_id` now (0 if llama.cpp cannot say)
    size_t seq_state_size(int32_t seq_id) const;
    // writes the state of `seq_id` (exactly seq_state_size bytes) to `dst`; false if llama.cpp could not
    bool seq_save(int32_t seq_id, uint8_t * dst, size_t size) const;
    // replaces `seq_id`'s cells with a state seq_save wrote on a context of the same model, range
    // and kv_type (never bytes from elsewhere: llama.cpp checks layer count, types and row sizes,
    // not where they came from); false (and `seq_id` empty) if llama.cpp refused it
    bool seq_restore(int32_t seq_id, const uint8_t * data, size_t size);

    // --- recurrent state (hybrid models: Mamba-2, gated delta-net layers beside attention) ---
    // the memory holds a recurrent state per sequence (for its recurrent layers, if it owns any):
    // llama.cpp cannot cut such a sequence back below its length (seq_rm refuses), so a cut goes
    // through a checkpoint (hot_kv_engine); the first position held is then the last one
    bool recurrent() const { return recurrent_; }
    // positions a token takes: 4 for M-RoPE (its sections), else 1
    int32_t n_pos_per_embd() const { return n_pos_per_embd_; }
    // the recurrent part of `seq_id`'s state (llama.cpp's PARTIAL_ONLY sequence state) into `out`;
    // false if llama.cpp could not write it
    bool seq_save_recurrent(int32_t seq_id, page_buffer & out) const;
    // replaces the recurrent part of `seq_id`'s state with bytes seq_save_recurrent wrote on this
    // context; the attention cells stay (cut them with seq_rm at the checkpoint's length after)
    bool seq_restore_recurrent(int32_t seq_id, const page_buffer & state);

    const std::string & kv_type() const { return kv_type_; }
    uint64_t kv_bytes_per_token() const { return kv_bytes_per_token_; }

    // validation shared with the session engine; throws shard_error(SHARD_ERRC_INVALID_ARGUMENT)
    void validate_input(const shard_input & input) const;
    void validate_seq_id(int32_t seq_id) const;

private:
    int32_t forward_batch_locked(const std::vector<batch_item> & items, bool inputs_validated);
    // decodes items order[first..) that fit one call into their outputs (rolling every item back on a
    // failure: roll_back throws); returns the end
    template <class RollBack>
    size_t decode_call(const std::vector<batch_item> & items, const std::vector<size_t> & order, size_t first,
                       RollBack & roll_back);
    // one row_by_row input of several tokens after the call's other items: one call where its row
    // count is proven, each row alone otherwise (the first time, after one call, compared)
    template <class RollBack>
    void forward_rows_locked(const batch_item & it, RollBack & roll_back);
    // forward_batch_locked's steps: check every item against the context (throws, nothing changed),
    // the order items are decoded in, one llama_decode's batch, and that call's outputs
    void                validate_batch_locked(const std::vector<batch_item> & items, bool inputs_validated) const;
    std::vector<size_t> decode_order(const std::vector<batch_item> & items) const;
    size_t              fill_batch(const std::vector<batch_item> & items, const std::vector<size_t> & order, size_t first);
    const char *        read_outputs(const std::vector<batch_item> & items, const std::vector<size_t> & order, size_t first,
                                     size_t last);
    int64_t n_cells_used_unlocked() const;

    const shard_model & model_;
    llama_context *     ctx_ = nullptr;
    // compute threads of its own (see the constructor), with ggml-cpu's functions for them (looked
    // up once, through the CPU device's registry: the module that computes)
    ggml_threadpool *   threadpool_ = nullptr;
    void              (*pool_pause_)(ggml_threadpool *) = nullptr;
    void              (*pool_free_)(ggml_threadpool *) = nullptr;
    bool                computing_ = false;  // between take_compute_turn and end_compute_turn (their mutex)
    void take_compute_turn();
    void end_compute_turn();
    // the constructor's step for a context of several compute threads: the pool above, attached to ctx_
    void attach_threadpool(int32_t n_threads);
    int32_t             n_ctx_ = 0;
    int32_t             n_seq_max_ = 0;
    int32_t             n_batch_ = 0;
    int32_t             n_ctx_seq_ = 0;
    uint64_t            n_decode_calls_ = 0;
    bool                kv_unified_ = true;
    bool                whole_rows_possible_ = false;
    bool                recurrent_ = false;
    int32_t             n_pos_per_embd_ = 1;  // positions a token takes (4: M-RoPE's sections)
    // by a row_by_row input's tokens (whole_rows_verdicts)
    enum : int8_t { WHOLE_ROWS_UNTRIED = 0, WHOLE_ROWS_ONE_CALL = 1, WHOLE_ROWS_SLOWER = 2, WHOLE_ROWS_DIFFER = -1 };
    std::array<int8_t, HOT_KV_MAX_LOGIT_ROWS + 1> whole_rows_verdict_{};
    std::string         kv_type_;
    uint64_t            kv_bytes_per_token_ = 0;
    mutable std::mutex  mutex_;

    struct batch_buffers;
    std::unique_ptr<batch_buffers> batch_;
};

} // namespace llama_shard
