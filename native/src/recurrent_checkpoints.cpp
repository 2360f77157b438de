#include "llama_shard/recurrent_checkpoints.h"

#include <algorithm>

namespace llama_shard {

shard_input recurrent_checkpoints::checkpoint::input(int32_t first, int32_t n) const {
    shard_input in;
    in.n_tokens = n;
    if (!tokens.empty()) {
        in.tokens = tokens.data() + first;
    } else {
        in.hidden      = hidden.data() + (size_t) first * (size_t) hidden_cols;
        in.hidden_cols = hidden_cols;
    }
    return in;
}

bool recurrent_checkpoints::wants(int32_t pos, int64_t n_tokens) const {
    if (points_.empty()) {
        return true;
    }
    const checkpoint & last = points_.back();  // it records this step whole, or a new one starts here
    return last.pos + last.rows != pos || last.rows + n_tokens > MAX_INPUT_ROWS;
}

void recurrent_checkpoints::take(int32_t pos, page_buffer state) {
    while (!points_.empty() && points_.back().pos >= pos) {
        points_.pop_back();  // one at this position is replaced (a step computed again after a cut)
    }
    if (points_.size() >= MAX_CHECKPOINTS) {
        points_.pop_front();
    }
    checkpoint c;
    c.pos   = pos;
    c.state = std::move(state);
    points_.push_back(std::move(c));
}

void recurrent_checkpoints::record(int32_t pos, const shard_input & input) {
    if (points_.empty()) {
        return;
    }
    checkpoint & c = points_.back();
    if (c.pos + c.rows != pos || c.rows >= MAX_INPUT_ROWS) {
        return;  // not contiguous with its inputs, or full
    }
    const int32_t n = (int32_t) std::min<int64_t>(input.n_tokens, MAX_INPUT_ROWS - c.rows);
    const bool whole = n == input.n_tokens;
    if (input.tokens != nullptr) {
        if (!c.hidden.empty()) {
            return;
        }
        c.tokens.insert(c.tokens.end(), input.tokens, input.tokens + n);
    } else {
        if (!c.tokens.empty() || (c.rows > 0 && c.hidden_cols != input.hidden_cols)) {
            return;
        }
        c.hidden_cols = input.hidden_cols;
        c.hidden.insert(c.hidden.end(), input.hidden, input.hidden + (size_t) n * (size_t) input.hidden_cols);
    }
    c.rows += n;
    if (input.row_by_row && whole) {
        c.steps.insert(c.steps.end(), (size_t) n, 1);  // each row was computed alone
    } else {
        c.steps.push_back(n);
    }
}

const recurrent_checkpoints::checkpoint * recurrent_checkpoints::covering(int32_t length) const {
    for (auto it = points_.rbegin(); it != points_.rend(); ++it) {
        if (it->pos <= length) {
            return it->pos + it->rows >= length ? &*it : nullptr;
        }
    }
    return nullptr;
}

void recurrent_checkpoints::cut(int32_t length) {
    while (!points_.empty() && points_.back().pos > length) {
        points_.pop_back();
    }
    if (points_.empty()) {
        return;
    }
    checkpoint & c = points_.back();
    const int32_t keep = std::max(0, std::min(c.rows, length - c.pos));
    if (!c.tokens.empty()) {
        c.tokens.resize((size_t) keep);
    }
    if (!c.hidden.empty()) {
        c.hidden.resize((size_t) keep * (size_t) c.hidden_cols);
    }
    c.rows = keep;
    int32_t left = keep;  // the steps up to the cut, the last one cut short
    size_t  k = 0;
    for (; k < c.steps.size() && left > 0; ++k) {
        c.steps[k] = std::min(c.steps[k], left);
        left -= c.steps[k];
    }
    c.steps.resize(k);
}

uint64_t recurrent_checkpoints::bytes() const {
    uint64_t total = 0;
    for (const checkpoint & c : points_) {
        total += c.state.size() + c.tokens.size() * sizeof(int32_t) + c.hidden.size() * sizeof(float) +
                 c.steps.size() * sizeof(int32_t);
    }
    return total;
}

}  // namespace llama_shard
