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
//
// State from elsewhere (a session handed over by another worker, hot_kv_engine::import_session) is
// also checked against the receiving context's layout (kv_state_layout): V transposed or not, the
// K and V element type and row size of every layer, and the owned layer count over the caches.
// llama.cpp at the pin refuses such a mismatch itself, with an error and no abort
// (llama-kv-cache.cpp state_read_data: layer count, V transposition, types, row sizes; a stream
// count or a size that does not fit: state_read_sinfo / llama_io_read_host, an exception that
// llama_state_seq_set_data catches), but only after it has placed the cells: checked here, such
// bytes are refused before the engine changes anything. What no layout shows is where the rows
// came from: another layer range of the same shape, another model of the same geometry (the
// caller's identity check: the recipe and the model, see HotKvStateManager.import_session).
// Values: state from elsewhere (an import, a warm file read back from disk) must also hold only
// finite K/V values. A NaN or Inf row restores without an error and turns every later token of the
// session into garbage; the sender's digest cannot catch it, since the sender made the digest. The
// check reads each type's own bits (float exponents, block-quantized scales), dequantizing nothing;
// a type it cannot read is refused. A state this engine wrote to its own memory is not re-checked.
// The stream count is the one field that may differ: a context with one KV stream per sequence
// writes one cell count per stream (n_seq_max of them), and llama.cpp restores the sequence's
// cells into the receiving sequence's own stream whatever index they were saved under, so
// kv_state_restream rewrites a state for a context with another number of streams.

#include "llama_shard/page_buffer.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace llama_shard {

// true if `data` is the state of one sequence of exactly seq_len tokens; `why` says what is not
// what a state holds besides its K rows, which a reader cannot tell from the bytes
struct kv_state_format {
    bool    v_rows = true;          // V rows follow the K rows (latent attention caches K only)
    int32_t recurrent_layers = -1;  // a hybrid's memory: after its one KV cache, a recurrent block of
                                    // this many layers' r and s rows (-1: no such block)
    uint32_t cell_ext_bytes = 0;    // a KV cell's extra record after its sequence count (M-RoPE: its
                                    // 2D position and token, llama_kv_cell_ext: 12 bytes)
};

bool kv_state_positions_ok(const uint8_t * data, size_t size, int32_t seq_len, std::string & why,
                           const kv_state_format & format = {});

// kv_state_positions_ok, and every K/V value finite (a row type whose values cannot be checked is
// refused); `why` says what is not
bool kv_state_values_ok(const uint8_t * data, size_t size, int32_t seq_len, std::string & why,
                        const kv_state_format & format = {});

// what the rows of a state restored on one context must be (hot_kv_engine fills it from its
// context: kv_type, flash attention, head geometry, owned layers)
struct kv_state_layout {
    uint32_t n_layers  = 0;      // owned layers: the caches' layer counts add up to this
    int32_t  type      = -1;     // ggml type of every K and V row
    // K and V elements per cell of each owned attention layer, in the order a state writes their rows
    // (llama_model_kv_state_widths: a full cache's layers, then a sliding-window cache's); layers may
    // differ (gemma4's sliding and full layers have other head sizes and KV heads)
    std::vector<int64_t> k_widths, v_widths;
    bool     v_trans   = false;  // V stored transposed (no flash attention): per layer an element size and width
    uint32_t el_bytes  = 0;      // V transposed: ggml_type_size(type)
    kv_state_format format;      // V rows or not, a recurrent block or not
    uint64_t recurrent_row_bytes = 0;  // a recurrent block: the r and s bytes of one cell over its layers
};

// kv_state_values_ok, and every row header as `layout` says; `why` says what is not
bool kv_state_restorable(const uint8_t * data, size_t size, int32_t seq_len, const kv_state_layout & layout,
                         std::string & why);

// the KV streams per cache a state lists (its first cache's; 0 if it is not a state)
uint32_t kv_state_streams(const uint8_t * data, size_t size);

// `data` (a state that kv_state_positions_ok accepted) rewritten with n_stream streams per cache:
// each cache's non-empty stream first, then empty ones. False (and `out` empty) if n_stream is 0,
// the state is not one this reader accepts, or the memory cannot be had.
bool kv_state_restream(const uint8_t * data, size_t size, int32_t seq_len, uint32_t n_stream, page_buffer & out,
                       const kv_state_format & format = {});

} // namespace llama_shard
