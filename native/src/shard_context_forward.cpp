// shard_context's compute: forward and forward_batch, the packing of items into llama_decode calls,
// a verification's rows (whole_rows_verdicts) and the roll back of a failed call. A file of its own:
// the context's construction and bookkeeping (shard_context.cpp) are read apart from its compute.

#include "llama_shard/shard_context.h"
#include "shard_context_internal.h"

#include "llama_shard/cpu_backend.h"  // shard_clear_llama_error, shard_last_llama_error

#include "llama.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <vector>

namespace llama_shard {

void shard_context::forward(int32_t seq_id, int32_t pos, const shard_input & input, float * out) {
    std::lock_guard<std::mutex> lock(mutex_);
    forward_batch_locked({batch_item{seq_id, pos, input, out}}, false);
}

int32_t shard_context::forward_batch(const std::vector<batch_item> & items, bool inputs_validated) {
    std::lock_guard<std::mutex> lock(mutex_);
    return forward_batch_locked(items, inputs_validated);
}

uint64_t shard_context::n_decode_calls() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return n_decode_calls_;
}

std::map<int32_t, std::string> shard_context::whole_rows_verdicts() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::map<int32_t, std::string> out;
    for (size_t n = 0; n < whole_rows_verdict_.size(); ++n) {
        switch (whole_rows_verdict_[n]) {
            case WHOLE_ROWS_ONE_CALL: out[(int32_t) n] = "one call"; break;
            case WHOLE_ROWS_SLOWER:   out[(int32_t) n] = "row by row: one call was slower"; break;
            case WHOLE_ROWS_DIFFER:   out[(int32_t) n] = "row by row: one call rounded differently"; break;
            default: break;
        }
    }
    return out;
}

template <class RollBack>
size_t shard_context::decode_call(const std::vector<batch_item> & items, const std::vector<size_t> & order, size_t first,
                                  RollBack & roll_back) {
    const size_t last = fill_batch(items, order, first);
    take_compute_turn();
    shard_clear_llama_error();  // cheap: an empty string
    const int32_t ret = llama_decode(ctx_, batch_->batch);
    end_compute_turn();
    ++n_decode_calls_;
    if (ret != 0) {
        const std::string why = shard_last_llama_error();
        roll_back("llama_decode failed with status " + str(ret) + (why.empty() ? std::string() : ": " + why),
                  ret == 1 ? SHARD_ERRC_CAPACITY : SHARD_ERRC_COMPUTE);
    }
    if (const char * missing = read_outputs(items, order, first, last)) {  // before the next decode overwrites them
        roll_back(missing, SHARD_ERRC_COMPUTE);
    }
    return last;
}

int32_t shard_context::forward_batch_locked(const std::vector<batch_item> & items, bool inputs_validated) {
    validate_batch_locked(items, inputs_validated);  // nothing reaches llama.cpp before this passes
    const std::vector<size_t> order = decode_order(items);
    llama_memory_t mem = llama_get_memory(ctx_);
    auto roll_back = [&](const std::string & why, shard_errc code) {
        for (const batch_item & it : items) {
            llama_memory_seq_rm(mem, it.seq_id, it.pos, -1);
        }
        throw shard_error(code, why);
    };
    // the items in order into llama_decode calls of at most n_batch tokens each; the row_by_row ones
    // (a verification: each row must round as a one-token step does) after them, each alone
    std::vector<batch_item> packed;
    std::vector<batch_item> by_rows;
    for (const size_t k : order) {
        const batch_item & it = items[k];
        (it.input.row_by_row && it.input.n_tokens > 1 ? by_rows : packed).push_back(it);
    }
    const uint64_t calls_before = n_decode_calls_;
    std::vector<size_t> in_order(packed.size());
    for (size_t k = 0; k < in_order.size(); ++k) {
        in_order[k] = k;
    }
    for (size_t first = 0; first < packed.size();) {
        first = decode_call(packed, in_order, first, roll_back);
    }
    try {
        for (const batch_item & it : by_rows) {
            forward_rows_locked(it, roll_back);
        }
    } catch (const std::bad_alloc &) {  // a compared call's buffers: nothing half-done stays
        roll_back("out of host memory for a verification's rows", SHARD_ERRC_COMPUTE);
    }
    return (int32_t) (n_decode_calls_ - calls_before);
}

template <class RollBack>
void shard_context::forward_rows_locked(const batch_item & it, RollBack & roll_back) {
    const shard_model_info & info = model_.info();
    const int32_t m = (int32_t) it.input.n_tokens;
    const size_t row_floats = (size_t) (info.is_tail ? info.n_vocab : info.n_embd);
    const std::vector<size_t> one{0};
    // llama.cpp's kernels and their order of sums may depend on a call's shape: a verdict per row
    // count says whether one call gives the rows' bytes (0: not tried yet; never where not possible)
    int8_t verdict = WHOLE_ROWS_DIFFER;
    if (whole_rows_possible_ && m < (int32_t) whole_rows_verdict_.size()) {
        verdict = whole_rows_verdict_[(size_t) m];
    }
    using clock = std::chrono::steady_clock;
    const clock::time_point t0 = clock::now();
    std::vector<float> whole_out;
    if (verdict == WHOLE_ROWS_UNTRIED || verdict == WHOLE_ROWS_ONE_CALL) {
        // every row's output (on the tail, logits of all m rows: the call's shape must not depend on
        // how many the caller wants)
        batch_item whole = it;
        whole.input.row_by_row = false;
        whole.input.n_logits = m;
        if (verdict == WHOLE_ROWS_UNTRIED || (info.is_tail && it.input.n_logits != m)) {
            whole_out.resize((size_t) m * row_floats);
            whole.out = whole_out.data();
        }
        decode_call(std::vector<batch_item>{whole}, one, 0, roll_back);
        if (verdict == WHOLE_ROWS_ONE_CALL) {
            if (whole.out != it.out) {  // the tail's last n_logits rows
                std::memcpy(it.out, whole_out.data() + (size_t) (m - it.input.n_logits) * row_floats,
                            sizeof(float) * (size_t) it.input.n_logits * row_floats);
            }
            return;
        }
        // not tried yet: cut the rows again, compute them one at a time below and compare
        if (!llama_memory_seq_rm(llama_get_memory(ctx_), it.seq_id, it.pos, -1)) {
            roll_back("llama.cpp could not cut a compared call's cells", SHARD_ERRC_COMPUTE);
        }
    }
    const clock::time_point t1 = clock::now();
    // each row alone: the outputs no one asked for (the tail's earlier rows) land in `rows_out`, as
    // every row does when they are compared
    std::vector<float> rows_out;
    if (verdict == WHOLE_ROWS_UNTRIED || (info.is_tail && it.input.n_logits != m)) {
        rows_out.resize((size_t) m * row_floats);
    }
    for (int32_t j = 0; j < m; ++j) {
        batch_item row = it;
        row.pos = it.pos + j;
        row.input.n_tokens = 1;
        row.input.n_logits = 1;
        row.input.row_by_row = false;
        if (it.input.tokens != nullptr) {
            row.input.tokens = it.input.tokens + j;
        } else {
            row.input.hidden = it.input.hidden + (size_t) j * info.n_embd;
        }
        const int32_t first_out = info.is_tail ? m - it.input.n_logits : 0;
        row.out = rows_out.empty() ? it.out + (size_t) (j - first_out) * row_floats : rows_out.data() + (size_t) j * row_floats;
        decode_call(std::vector<batch_item>{row}, one, 0, roll_back);
    }
    if (!rows_out.empty()) {
        const int32_t n_out = info.is_tail ? it.input.n_logits : m;
        std::memcpy(it.out, rows_out.data() + (size_t) (m - n_out) * row_floats, sizeof(float) * (size_t) n_out * row_floats);
    }
    if (verdict == WHOLE_ROWS_UNTRIED) {
        // equal bytes make one call exact for m rows; it is taken where it was also the faster here
        // (on AVX2 a small model's m rows cost about m rows' time either way; AMX's tiles take less)
        const bool same = std::memcmp(whole_out.data(), rows_out.data(), sizeof(float) * whole_out.size()) == 0;
        whole_rows_verdict_[(size_t) m] = !same ? WHOLE_ROWS_DIFFER : t1 - t0 <= clock::now() - t1 ? WHOLE_ROWS_ONE_CALL
                                                                                                   : WHOLE_ROWS_SLOWER;
    }
}

void shard_context::validate_batch_locked(const std::vector<batch_item> & items, bool inputs_validated) const {
    if (items.empty()) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "empty batch");
    }
    llama_memory_t mem = llama_get_memory(ctx_);
    std::vector<bool> seen((size_t) n_seq_max_, false);
    int64_t n_new = 0;
    for (const batch_item & it : items) {
        validate_seq_id(it.seq_id);
        if (!inputs_validated) {
            validate_input(it.input);
        }
        if (seen[(size_t) it.seq_id]) {
            throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "sequence " + str(it.seq_id) + " appears twice in one batch");
        }
        seen[(size_t) it.seq_id] = true;
        const int32_t next = llama_memory_seq_pos_max(mem, it.seq_id) + 1;
        if (it.pos != next) {
            throw shard_error(SHARD_ERRC_INVALID_ARGUMENT,
                "start position " + str(it.pos) + " does not continue sequence " + str(it.seq_id) + " (next position is " +
                str(next) + "); remove the suffix with seq_rm first");
        }
        if (!kv_unified_ && (int64_t) it.pos + it.input.n_tokens > n_ctx_seq_) {
            throw shard_error(SHARD_ERRC_CAPACITY,
                "sequence " + str(it.seq_id) + " holds " + str(it.pos) + " of its " + str(n_ctx_seq_) + " cells; " +
                str(it.input.n_tokens) + " more do not fit");
        }
        n_new += it.input.n_tokens;
    }
    const int64_t n_used = kv_unified_ ? n_cells_used_unlocked() : 0;
    if (kv_unified_ && n_used + n_new > n_ctx_) {
        throw shard_error(SHARD_ERRC_CAPACITY,
            "the context holds " + str(n_used) + " of " + str(n_ctx_) + " cells; " + str(n_new) + " more do not fit");
    }
}

// With one KV stream per sequence, llama.cpp puts into one ubatch (one graph computation) only
// sequences whose ids follow each other in batch order (split_equal, sequential): items go in
// ascending seq_id order, so a run of consecutive ids costs one pass over the weights, not one each.
std::vector<size_t> shard_context::decode_order(const std::vector<batch_item> & items) const {
    std::vector<size_t> order(items.size());
    for (size_t k = 0; k < order.size(); ++k) {
        order[k] = k;
    }
    if (!kv_unified_) {
        std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return items[a].seq_id < items[b].seq_id; });
    }
    return order;
}

// fills the batch with items order[first..) while they fit in n_batch tokens (each one does:
// validate_input bounds it); returns the end of the run
size_t shard_context::fill_batch(const std::vector<batch_item> & items, const std::vector<size_t> & order, size_t first) {
    const shard_model_info & info = model_.info();
    llama_batch & batch = batch_->batch;
    size_t last = first;
    int32_t row = 0;
    for (; last < order.size() && row + items[order[last]].input.n_tokens <= n_batch_; ++last) {
        const batch_item & it = items[order[last]];
        const int32_t m = (int32_t) it.input.n_tokens;
        if (it.input.tokens != nullptr) {
            std::memcpy(batch.token + row, it.input.tokens, sizeof(int32_t) * (size_t) m);
        } else {
            std::memcpy(batch.embd + (size_t) row * info.n_embd, it.input.hidden,
                        sizeof(float) * (size_t) m * (size_t) info.n_embd);
        }
        for (int32_t i = 0; i < m; ++i, ++row) {
            batch.pos[row]       = it.pos + i;
            batch.n_seq_id[row]  = 1;
            batch.seq_id[row][0] = it.seq_id;
            batch.logits[row]    = info.is_tail ? (i >= m - it.input.n_logits) : 1;  // the tail: the last n_logits only
        }
    }
    batch.n_tokens = row;
    if (n_pos_per_embd_ > 1 && batch.embd != nullptr) {  // a residual batch (its buffers hold n_pos_per_embd_ positions a row)
        // M-RoPE with a residual input: a text token's sections all take its position, the last 0
        // (what llama.cpp gives a token input: llm_graph_input_pos::set_input)
        for (int32_t j = 1; j < n_pos_per_embd_; ++j) {
            for (int32_t i = 0; i < row; ++i) {
                batch.pos[j * row + i] = j + 1 < n_pos_per_embd_ ? batch.pos[i] : 0;
            }
        }
    }
    return last;
}

// copies the outputs of items order[first..last) (logits of each item's last n_logits tokens on the tail,
// every token's hidden state elsewhere); null, or what llama.cpp failed to return
const char * shard_context::read_outputs(const std::vector<batch_item> & items, const std::vector<size_t> & order,
                                         size_t first, size_t last) {
    const shard_model_info & info = model_.info();
    int32_t row = 0;
    for (size_t k = first; k < last; ++k) {
        const batch_item & it = items[order[k]];
        const int32_t m = (int32_t) it.input.n_tokens;
        if (info.is_tail) {
            const int32_t n_out = it.input.n_logits;
            for (int32_t j = 0; j < n_out; ++j) {
                const float * logits = llama_get_logits_ith(ctx_, row + m - n_out + j);
                if (logits == nullptr) {
                    return "llama.cpp returned no logits";
                }
                std::memcpy(it.out + (size_t) j * info.n_vocab, logits, sizeof(float) * (size_t) info.n_vocab);
            }
        } else {
            for (int32_t i = 0; i < m; ++i) {
                const float * h = llama_get_embeddings_ith(ctx_, row + i);
                if (h == nullptr) {
                    return "llama.cpp returned no hidden state";
                }
                std::memcpy(it.out + (size_t) i * info.n_embd, h, sizeof(float) * (size_t) info.n_embd);
            }
        }
        row += m;
    }
    return nullptr;
}

} // namespace llama_shard
