#pragma once

// Checkpoints of one session's recurrent state, so that a hybrid model's session can be cut back.
//
// A recurrent layer (Mamba-2, gated delta-net) holds one state per sequence, not a cell per token:
// llama.cpp cannot remove the last tokens of such a sequence (seq_rm refuses). The session contract
// cuts back all the time: a verification's rejected drafts, a next turn that re-renders the end of
// the last answer, a retried prefill. So the engine keeps, per session, a few checkpoints: the
// recurrent state at a position (llama.cpp's PARTIAL_ONLY sequence state) and the inputs of the
// steps that followed it (token ids on the head, hidden rows elsewhere), up to a bound. A cut to a
// length L restores the latest checkpoint at or before L whose inputs reach L, removes the
// attention cells from its position on, and computes the inputs up to L again: the state the
// session had at L, bit for bit (the same operations on the same values). A cut no checkpoint
// covers is a cache miss (the head re-prefills), never a wrong state.
//
// The inputs are computed again step by step, each with the rows it had (a kernel may choose by a
// call's row count), so a cut between steps gives the state the session had, bit for bit; a cut
// inside a step (a prompt cut back into: a next turn re-rendering it) computes that step's rows up
// to the cut in one call, which a fresh run of the same tokens rounds alike only where the kernels
// do not depend on the row count. A verification's rows are steps of one row each (row_by_row).
//
// Where checkpoints are taken (hot_kv_engine, wants()): before a session's first step, and before
// a step whose inputs the latest one cannot record (not contiguous, or past MAX_INPUT_ROWS), so a
// cut back within the last MAX_CHECKPOINTS x MAX_INPUT_ROWS tokens or so is covered (a step longer
// than MAX_INPUT_ROWS, a long prompt, is covered up to its first MAX_INPUT_ROWS rows). Their bytes
// count in the session's host memory (bytes()).
//
// Invariants: checkpoints are in increasing position order; each one's inputs start at its
// position and are contiguous, in whole steps except a last one cut short; only the latest one's
// inputs grow.

#include "llama_shard/page_buffer.h"
#include "llama_shard/shard_context.h"

#include <cstdint>
#include <deque>
#include <vector>

namespace llama_shard {

class recurrent_checkpoints {
public:
    static constexpr size_t  MAX_CHECKPOINTS = 8;
    static constexpr int32_t MAX_INPUT_ROWS  = 16;

    struct checkpoint {
        int32_t              pos = 0;  // the session's length when it was taken
        page_buffer          state;    // the recurrent part of the sequence state at pos
        std::vector<int32_t> tokens;   // the inputs after pos: token ids (head) ...
        std::vector<float>   hidden;   // ... or hidden rows of hidden_cols floats
        int64_t              hidden_cols = 0;
        int32_t              rows = 0; // inputs recorded after pos
        std::vector<int32_t> steps;    // the rows of each step they came in (they sum to `rows`)

        // recorded inputs [first, first + n), as a forward() input
        shard_input input(int32_t first, int32_t n) const;
    };

    // whether the next step (of n_tokens, at the session's length `pos`) should start with a checkpoint
    bool wants(int32_t pos, int64_t n_tokens) const;
    // a checkpoint at `pos` (the oldest goes when there are MAX_CHECKPOINTS)
    void take(int32_t pos, page_buffer state);
    // a step computed at the session's end: its inputs are recorded after the latest checkpoint
    // (while there is room; a full one stops recording, and wants() asks for the next)
    void record(int32_t pos, const shard_input & input);
    // the checkpoint a cut to `length` restores (latest at or before it whose inputs reach it), or null
    const checkpoint * covering(int32_t length) const;
    // the session was cut to `length` through `covering(length)`: later checkpoints go, its inputs
    // past `length` too
    void cut(int32_t length);
    void clear() { points_.clear(); }

    size_t   size() const { return points_.size(); }
    uint64_t bytes() const;  // host memory the checkpoints hold

private:
    std::deque<checkpoint> points_;
};

}  // namespace llama_shard
