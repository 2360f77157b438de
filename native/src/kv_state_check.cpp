#include "llama_shard/kv_state_check.h"

#include "ggml.h"

#include <cstring>
#include <vector>

namespace llama_shard {

namespace {

constexpr uint32_t STATE_MAGIC = 0xaf143cd8;  // io_magic, src/llama-context.cpp
constexpr uint32_t MAX_STREAMS = 1u << 16;
constexpr uint32_t MAX_LAYERS  = 1u << 12;

struct cursor {
    const uint8_t * p;
    size_t          left;
    template <typename T> bool get(T & v) {
        if (left < sizeof(T)) {
            return false;
        }
        std::memcpy(&v, p, sizeof(T));
        p += sizeof(T);
        left -= sizeof(T);
        return true;
    }
    // skips count * size bytes, refusing a product that overflows or runs past the end
    bool skip(uint64_t count, uint64_t size) {
        if (size != 0 && count > (uint64_t) left / size) {
            return false;
        }
        p += count * size;
        left -= (size_t) (count * size);
        return true;
    }
};

// the bytes of one cache's record that hold the sequence: its non-empty stream, from its cell count
// to the end of its rows (offsets into the state)
struct stream_span {
    size_t begin = 0;
    size_t end   = 0;
};

// --- values -----------------------------------------------------------------------------------
// A K/V value is finite exactly when its type's own bits say so, so nothing is dequantized: a float
// type by its exponent (all ones: Inf or NaN), a block-quantized type by its block's f16 scale (and
// minimum), whose integer quants times a finite scale are finite.

// no element of n `Bits`-wide values has all of `exponent`'s bits set (Inf or NaN); branch-free,
// so the loop vectorizes
template <typename Bits> bool no_exponent_all_ones(const uint8_t * p, uint64_t n, Bits exponent) {
    uint32_t bad = 0;
    for (uint64_t i = 0; i < n; ++i) {
        Bits v;
        std::memcpy(&v, p + sizeof(Bits) * i, sizeof(Bits));
        bad |= (uint32_t) ((v & exponent) == exponent);
    }
    return bad == 0;
}

// the f16 halves at the start of each block that scale it: d, and m for the "_1" types
bool block_scales_finite(const uint8_t * p, uint64_t bytes, size_t block_bytes, int n_scales) {
    uint32_t bad = 0;
    for (uint64_t at = 0; at + block_bytes <= bytes; at += block_bytes) {
        for (int k = 0; k < n_scales; ++k) {
            uint16_t h;
            std::memcpy(&h, p + at + 2 * k, 2);
            bad |= (uint32_t) ((h & 0x7c00u) == 0x7c00u);
        }
    }
    return bad == 0;
}

// true if every value of `bytes` bytes of `type` is finite; false for a type this check cannot read
bool values_finite(int32_t type, const uint8_t * p, uint64_t bytes) {
    switch (type) {
        case GGML_TYPE_F32:  return bytes % 4 == 0 && no_exponent_all_ones<uint32_t>(p, bytes / 4, 0x7f800000u);
        case GGML_TYPE_F16:  return bytes % 2 == 0 && no_exponent_all_ones<uint16_t>(p, bytes / 2, 0x7c00u);
        case GGML_TYPE_BF16: return bytes % 2 == 0 && no_exponent_all_ones<uint16_t>(p, bytes / 2, 0x7f80u);
        case GGML_TYPE_Q8_0:
        case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q5_0:
        case GGML_TYPE_Q4_1:
        case GGML_TYPE_Q5_1: {
            const size_t block = ggml_type_size((ggml_type) type);
            const int    n_scales = (type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q5_1) ? 2 : 1;
            return bytes % block == 0 && block_scales_finite(p, bytes, block, n_scales);
        }
        default:
            return false;
    }
}

// the rows of one stream's cells: K per layer, then V per layer (rows, or transposed elements);
// each header checked against `layout` when there is one, every value checked finite when
// `check_values`; the cache's layer count added to `layers`
bool skip_rows(cursor & c, uint32_t cells, const kv_state_layout * layout, bool check_values, bool v_rows,
               uint64_t & layers, std::string & why) {
    uint32_t v_trans = 0, n_layer = 0;
    if (!c.get(v_trans) || !c.get(n_layer) || v_trans > 1 || n_layer > MAX_LAYERS) {
        why = "a bad row header";
        return false;
    }
    if (layout != nullptr && (v_trans != 0) != layout->v_trans) {
        why = std::string("V rows ") + (v_trans ? "transposed" : "not transposed") + ", this context stores them " +
              (layout->v_trans ? "transposed" : "not transposed") + " (flash attention)";
        return false;
    }
    const uint64_t first_layer = layers;  // this cache's first layer among the context's owned ones
    layers += n_layer;
    if (layout != nullptr && layers > layout->k_widths.size()) {
        why = "rows of more layers than this context owns (" + std::to_string(layout->k_widths.size()) + ")";
        return false;
    }
    // K rows of every layer, then V rows of every layer (none where latent attention caches no V)
    for (uint32_t l = 0; l < (v_rows ? 2 : 1) * n_layer; ++l) {
        const char * kv = l < n_layer ? "K" : "V";
        const int64_t width = layout == nullptr ? 0 :
            (l < n_layer ? layout->k_widths : layout->v_widths)[first_layer + l % n_layer];
        int32_t type = 0;
        if (!c.get(type)) {
            why = "truncated rows";
            return false;
        }
        if (layout != nullptr && type != layout->type) {
            why = std::string(kv) + " rows of ggml type " + std::to_string(type) + ", this context's are type " +
                  std::to_string(layout->type);
            return false;
        }
        if (l < n_layer || !v_trans) {
            uint64_t row = 0;
            if (!c.get(row)) {
                why = "truncated rows";
                return false;
            }
            if (layout != nullptr && row != ggml_row_size((ggml_type) layout->type, width)) {
                why = std::string(kv) + " rows of " + std::to_string(row) + " bytes, this context's are " +
                      std::to_string(ggml_row_size((ggml_type) layout->type, width));
                return false;
            }
            const uint8_t * rows = c.p;
            if (!c.skip(cells, row)) {
                why = "rows past the end of the state";
                return false;
            }
            if (check_values && !values_finite(type, rows, (uint64_t) cells * row)) {
                why = std::string(kv) + " rows of layer " + std::to_string(l % n_layer) + " hold a value that is not " +
                      "finite (NaN or Inf), or are of ggml type " + std::to_string(type) + ", whose values are not checked";
                return false;
            }
        } else {
            uint32_t el = 0, n_embd = 0;
            if (!c.get(el) || !c.get(n_embd)) {
                why = "truncated rows";
                return false;
            }
            if (layout != nullptr && (el != layout->el_bytes || (int64_t) n_embd != width)) {
                why = "V rows of " + std::to_string(n_embd) + " elements of " + std::to_string(el) + " bytes, this context's are " +
                      std::to_string(width) + " of " + std::to_string(layout->el_bytes);
                return false;
            }
            const uint8_t * rows = c.p;
            if (!c.skip((uint64_t) cells * n_embd, el)) {
                why = "rows past the end of the state";
                return false;
            }
            if (check_values && !values_finite(type, rows, (uint64_t) cells * n_embd * el)) {
                why = std::string(kv) + " rows of layer " + std::to_string(l % n_layer) + " hold a value that is not " +
                      "finite (NaN or Inf), or are of ggml type " + std::to_string(type) + ", whose values are not checked";
                return false;
            }
        }
    }
    return true;
}

// a hybrid memory's recurrent block (llama-memory-recurrent.cpp state_write): one cell at the
// sequence's last position, then r rows per recurrent layer, then s rows per recurrent layer (f32)
bool read_recurrent(cursor & c, int32_t seq_len, const kv_state_format & format, const kv_state_layout * layout,
                    bool check_values, std::string & why) {
    uint32_t cells = 0;
    if (!c.get(cells) || cells != 1) {
        why = "a recurrent state that is not one cell";
        return false;
    }
    int32_t pos = 0;
    uint32_t n_seq = 0, s_trans = 0, n_layer = 0;
    if (!c.get(pos) || !c.get(n_seq) || n_seq != 0) {  // one sequence's state names no sequence
        why = "a recurrent cell that is not of one sequence";
        return false;
    }
    if (pos != seq_len - 1) {
        why = "a recurrent state at position " + std::to_string(pos) + " for " + std::to_string(seq_len) + " tokens";
        return false;
    }
    if (!c.get(s_trans) || s_trans != 0 || !c.get(n_layer) || n_layer > MAX_LAYERS ||
        (uint32_t) format.recurrent_layers > n_layer) {
        why = "a bad recurrent row header";
        return false;
    }
    uint64_t row_bytes = 0;
    for (int32_t l = 0; l < 2 * format.recurrent_layers; ++l) {
        int32_t type = 0;
        uint64_t row = 0;
        if (!c.get(type) || type != GGML_TYPE_F32 || !c.get(row)) {
            why = "a recurrent row that is not f32";
            return false;
        }
        const uint8_t * rows = c.p;
        if (!c.skip(1, row)) {
            why = "recurrent rows past the end of the state";
            return false;
        }
        if (check_values && !values_finite(type, rows, row)) {
            why = "a recurrent state value that is not finite (NaN or Inf)";
            return false;
        }
        row_bytes += row;
    }
    if (layout != nullptr && row_bytes != layout->recurrent_row_bytes) {
        why = "recurrent rows of " + std::to_string(row_bytes) + " bytes, this context's are " +
              std::to_string(layout->recurrent_row_bytes);
        return false;
    }
    return true;
}

// what read_state reads a state against, the same for each of its caches
struct read_inputs {
    size_t                  size;          // the state's bytes: a span's offsets are into them
    int32_t                 seq_len;
    const kv_state_layout * layout;        // each row header checked against it when given
    bool                    check_values;  // every K/V value finite
    const kv_state_format & format;
};

// the cells of one stream of cache `cache` that holds the sequence: cache 0 exactly positions
// 0..seq_len-1, a later (sliding-window) cache consecutive ones that end at seq_len-1, in order,
// each cell of one sequence
bool read_cells(cursor & c, int cache, uint32_t cells, const read_inputs & in, std::string & why) {
    const uint32_t want = (uint32_t) in.seq_len;
    if (cells > want || (cache == 0 && cells != want)) {
        why = "cache " + std::to_string(cache) + " holds " + std::to_string(cells) + " cells for " +
              std::to_string(in.seq_len) + " tokens";
        return false;
    }
    const int32_t first = (int32_t) (want - cells);  // cache 0: 0; a sliding window: its start
    for (uint32_t i = 0; i < cells; ++i) {
        int32_t pos = 0, seq = 0;
        uint32_t n_seq = 0;
        if (!c.get(pos) || !c.get(n_seq) || n_seq != 1 || !c.skip(1, in.format.cell_ext_bytes) || !c.get(seq)) {
            why = "a cell that is not of one sequence";
            return false;
        }
        if (pos != first + (int32_t) i) {
            why = "cache " + std::to_string(cache) + " cell " + std::to_string(i) + " at position " +
                  std::to_string(pos) + ", expected " + std::to_string(first + (int32_t) i);
            return false;
        }
    }
    return true;
}

// one cache's record: its stream count (as many as the first cache's, `streams`), then per stream
// a cell count, the cells and their rows; the sequence in exactly one stream, whose span is
// appended to `spans` when given; the rows' layers added to `layers`
bool read_cache(cursor & c, int cache, uint32_t & streams, const read_inputs & in, uint64_t & layers,
                std::vector<stream_span> * spans, std::string & why) {
    uint32_t n_stream = 0;
    if (!c.get(n_stream) || n_stream == 0 || n_stream > MAX_STREAMS || (cache > 0 && n_stream != streams)) {
        why = "a bad stream count";
        return false;
    }
    streams = n_stream;
    uint32_t streams_used = 0;
    stream_span span;
    for (uint32_t s = 0; s < n_stream; ++s) {
        const size_t at = in.size - c.left;
        uint32_t cells = 0;
        if (!c.get(cells)) {
            why = "truncated cell count";
            return false;
        }
        if (cells == 0) {
            continue;
        }
        if (++streams_used > 1) {
            why = "the sequence's cells are in two streams";
            return false;
        }
        if (!read_cells(c, cache, cells, in, why) ||
            !skip_rows(c, cells, in.layout, in.check_values, in.format.v_rows, layers, why)) {
            return false;
        }
        span = stream_span{at, in.size - c.left};
    }
    if (streams_used == 0) {
        why = "cache " + std::to_string(cache) + " holds no cell of the sequence";
        return false;
    }
    if (spans != nullptr) {
        spans->push_back(span);
    }
    return true;
}

// the one reader: positions, the rows against `layout` when given and their values when
// `check_values`; each cache's span of the sequence appended to `spans` when given, and where a
// recurrent block starts in `recurrent_begin`
bool read_state(const uint8_t * data, size_t size, int32_t seq_len, const kv_state_layout * layout, bool check_values,
                const kv_state_format & format, std::vector<stream_span> * spans, std::string & why,
                size_t * recurrent_begin = nullptr) {
    cursor c{data, data != nullptr ? size : 0};
    uint32_t magic = 0;
    int32_t saved_seq = 0;
    if (seq_len < 1 || !c.get(magic) || magic != STATE_MAGIC || !c.get(saved_seq)) {
        why = "not a sequence state";
        return false;
    }
    const read_inputs in{size, seq_len, layout, check_values, format};
    uint64_t layers = 0;
    uint32_t streams = 0;  // the first cache's count: every cache of a context has as many
    int cache = 0;
    const bool recurrent = format.recurrent_layers >= 0;
    for (; c.left > 0 && !(recurrent && cache == 1); ++cache) {
        if (!read_cache(c, cache, streams, in, layers, spans, why)) {
            return false;
        }
        if (cache >= 1 && c.left > 0 && !recurrent) {
            why = "more than two caches";
            return false;
        }
    }
    if (recurrent) {
        if (recurrent_begin != nullptr) {
            *recurrent_begin = size - c.left;
        }
        if (!read_recurrent(c, seq_len, format, layout, check_values, why)) {
            return false;
        }
        if (c.left > 0) {
            why = "bytes after the recurrent state";
            return false;
        }
    }
    if (cache == 0) {
        why = "no cache in the state";
        return false;
    }
    if (layout != nullptr && layers != layout->n_layers) {
        why = "rows of " + std::to_string(layers) + " layers, this context owns " + std::to_string(layout->n_layers);
        return false;
    }
    return true;
}

} // namespace

bool kv_state_positions_ok(const uint8_t * data, size_t size, int32_t seq_len, std::string & why,
                           const kv_state_format & format) {
    return read_state(data, size, seq_len, nullptr, false, format, nullptr, why);
}

bool kv_state_values_ok(const uint8_t * data, size_t size, int32_t seq_len, std::string & why,
                        const kv_state_format & format) {
    return read_state(data, size, seq_len, nullptr, true, format, nullptr, why);
}

bool kv_state_restorable(const uint8_t * data, size_t size, int32_t seq_len, const kv_state_layout & layout,
                         std::string & why) {
    return read_state(data, size, seq_len, &layout, true, layout.format, nullptr, why);
}

uint32_t kv_state_streams(const uint8_t * data, size_t size) {
    cursor c{data, data != nullptr ? size : 0};
    uint32_t magic = 0, n_stream = 0;
    int32_t saved_seq = 0;
    if (!c.get(magic) || magic != STATE_MAGIC || !c.get(saved_seq) || !c.get(n_stream)) {
        return 0;
    }
    return n_stream;
}

bool kv_state_restream(const uint8_t * data, size_t size, int32_t seq_len, uint32_t n_stream, page_buffer & out,
                       const kv_state_format & format) {
    out.reset();
    std::vector<stream_span> spans;
    std::string why;
    size_t tail = size;  // a recurrent block after the caches, copied as it is
    if (n_stream == 0 || n_stream > MAX_STREAMS || !read_state(data, size, seq_len, nullptr, false, format, &spans, why, &tail)) {
        return false;
    }
    const size_t header = sizeof(uint32_t) + sizeof(int32_t);  // magic, saved seq id
    size_t total = header + (size - tail);
    for (const stream_span & s : spans) {
        total += sizeof(uint32_t) + (s.end - s.begin) + sizeof(uint32_t) * (n_stream - 1);
    }
    page_buffer buf = page_buffer::allocate(total);
    if (buf.empty()) {
        return false;
    }
    uint8_t * p = buf.data();
    std::memcpy(p, data, header);
    p += header;
    for (const stream_span & s : spans) {
        std::memcpy(p, &n_stream, sizeof(n_stream));
        p += sizeof(n_stream);
        std::memcpy(p, data + s.begin, s.end - s.begin);
        p += s.end - s.begin;
        std::memset(p, 0, sizeof(uint32_t) * (n_stream - 1));  // the empty streams' cell counts
        p += sizeof(uint32_t) * (n_stream - 1);
    }
    std::memcpy(p, data + tail, size - tail);
    out = std::move(buf);
    return true;
}

} // namespace llama_shard
