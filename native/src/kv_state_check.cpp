#include "llama_shard/kv_state_check.h"

#include <cstring>

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

// the rows of one stream's cells: K per layer, then V per layer (rows, or transposed elements)
bool skip_rows(cursor & c, uint32_t cells, std::string & why) {
    uint32_t v_trans = 0, n_layer = 0;
    if (!c.get(v_trans) || !c.get(n_layer) || v_trans > 1 || n_layer > MAX_LAYERS) {
        why = "a bad row header";
        return false;
    }
    for (uint32_t l = 0; l < 2 * n_layer; ++l) {
        int32_t type = 0;
        if (!c.get(type)) {
            why = "truncated rows";
            return false;
        }
        if (l < n_layer || !v_trans) {
            uint64_t row = 0;
            if (!c.get(row) || !c.skip(cells, row)) {
                why = "rows past the end of the state";
                return false;
            }
        } else {
            uint32_t el = 0, n_embd = 0;
            if (!c.get(el) || !c.get(n_embd) || !c.skip((uint64_t) cells * n_embd, el)) {
                why = "rows past the end of the state";
                return false;
            }
        }
    }
    return true;
}

} // namespace

bool kv_state_positions_ok(const uint8_t * data, size_t size, int32_t seq_len, std::string & why) {
    cursor c{data, data != nullptr ? size : 0};
    uint32_t magic = 0;
    int32_t saved_seq = 0;
    if (seq_len < 1 || !c.get(magic) || magic != STATE_MAGIC || !c.get(saved_seq)) {
        why = "not a sequence state";
        return false;
    }
    int cache = 0;
    for (; c.left > 0; ++cache) {
        uint32_t n_stream = 0;
        if (!c.get(n_stream) || n_stream == 0 || n_stream > MAX_STREAMS) {
            why = "a bad stream count";
            return false;
        }
        uint32_t streams_used = 0;
        for (uint32_t s = 0; s < n_stream; ++s) {
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
            const uint32_t want = (uint32_t) seq_len;
            if (cells > want || (cache == 0 && cells != want)) {
                why = "cache " + std::to_string(cache) + " holds " + std::to_string(cells) + " cells for " +
                      std::to_string(seq_len) + " tokens";
                return false;
            }
            const int32_t first = (int32_t) (want - cells);  // cache 0: 0; a sliding window: its start
            for (uint32_t i = 0; i < cells; ++i) {
                int32_t pos = 0, seq = 0;
                uint32_t n_seq = 0;
                if (!c.get(pos) || !c.get(n_seq) || n_seq != 1 || !c.get(seq)) {
                    why = "a cell that is not of one sequence";
                    return false;
                }
                if (pos != first + (int32_t) i) {
                    why = "cache " + std::to_string(cache) + " cell " + std::to_string(i) + " at position " +
                          std::to_string(pos) + ", expected " + std::to_string(first + (int32_t) i);
                    return false;
                }
            }
            if (!skip_rows(c, cells, why)) {
                return false;
            }
        }
        if (streams_used == 0) {
            why = "cache " + std::to_string(cache) + " holds no cell of the sequence";
            return false;
        }
        if (cache >= 1 && c.left > 0) {
            why = "more than two caches";
            return false;
        }
    }
    if (cache == 0) {
        why = "no cache in the state";
        return false;
    }
    return true;
}

} // namespace llama_shard
