#pragma once

// kv_state_check: reads the cell list of a llama.cpp sequence state (llama_state_seq_get_data at the
// pin) before it is handed back to llama.cpp, and accepts it only if its positions are those of a
// session of seq_len tokens.
//
// The layout read (src/llama-context.cpp state_seq_get_data, src/llama-kv-cache.cpp state_write,
// src/llama-kv-cache-iswa.cpp): a u32 magic and the saved seq id, then one record per KV cache (one,
// or two for an interleaved-SWA model: the full cache, then the sliding-window one), each a u32
// stream count and per stream a u32 cell count, then per cell (pos i32, n_seq_id u32, seq_id i32),
// then the K and V rows, whose sizes the record states.
// Invariants checked:
//  - the sequence's cells are in exactly one stream of each cache; each cell names one sequence;
//  - the first cache holds exactly positions 0..seq_len-1, in order; a later (sliding-window)
//    cache holds consecutive positions that end at seq_len-1;
//  - the row sizes add up to exactly the buffer's size.
// llama.cpp restores whatever positions a state lists (src/llama-kv-cache.cpp state_read_meta): a
// cell at position -1 loads, and the session then decodes wrong logits without an error. A layout
// this reader does not know (cells with extensions, caches without V rows: M-RoPE, Gemma 3n, MLA)
// is refused, which costs a cache miss, never a wrong answer.

#include <cstddef>
#include <cstdint>
#include <string>

namespace llama_shard {

// true if `data` is the state of one sequence of exactly seq_len tokens; `why` says what is not
bool kv_state_positions_ok(const uint8_t * data, size_t size, int32_t seq_len, std::string & why);

} // namespace llama_shard
