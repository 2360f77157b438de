#include "llama_shard/token_sampler.h"

#include "llama_shard/hot_kv_limits.h"
#include "llama_shard/shard_error.h"

#include "llama.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace llama_shard {

static void bad(const std::string & what) {
    throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "sampling: " + what);
}

static bool within(float v, float lo, float hi) {
    return std::isfinite(v) && v >= lo && v <= hi;
}

sampling_problem sampling_find_problem(const sampling_params & p, int32_t n_vocab, int32_t max_penalty_last_n) {
    if (n_vocab < 1) {
        return {"n_vocab", "the vocabulary is empty"};
    }
    if (!std::isfinite(p.temperature) || (p.temperature != 0.0f && !within(p.temperature, SAMPLING_MIN_TEMPERATURE, 100.0f))) {
        return {"temperature", "temperature must be 0 or in [0.001, 100], got " + std::to_string(p.temperature)};
    }
    if (p.top_k < 0 || p.top_k > n_vocab) {
        return {"top_k", "top_k must be in [0, " + std::to_string(n_vocab) + "] (0: off), got " + std::to_string(p.top_k)};
    }
    if (!std::isfinite(p.top_p) || p.top_p <= 0.0f || p.top_p > 1.0f) {
        return {"top_p", "top_p must be in (0, 1], got " + std::to_string(p.top_p)};
    }
    if (!within(p.min_p, 0.0f, 1.0f)) {
        return {"min_p", "min_p must be in [0, 1], got " + std::to_string(p.min_p)};
    }
    // no session is longer than HOT_KV_MAX_CONTEXT_TOKENS: a longer window only allocates
    const int32_t max_last_n = std::min(max_penalty_last_n, HOT_KV_MAX_CONTEXT_TOKENS);
    if (p.penalty_last_n < 0 || p.penalty_last_n > max_last_n) {
        return {"penalty_last_n", "penalty_last_n must be in [0, " + std::to_string(max_last_n) + "], got " +
                                      std::to_string(p.penalty_last_n)};
    }
    if (!within(p.penalty_repeat, 0.01f, 100.0f)) {
        return {"penalty_repeat", "repeat penalty must be in [0.01, 100] (1: off), got " + std::to_string(p.penalty_repeat)};
    }
    if (!within(p.penalty_freq, -100.0f, 100.0f)) {
        return {"penalty_freq", "frequency penalty must be in [-100, 100], got " + std::to_string(p.penalty_freq)};
    }
    if (!within(p.penalty_present, -100.0f, 100.0f)) {
        return {"penalty_present", "presence penalty must be in [-100, 100], got " + std::to_string(p.penalty_present)};
    }
    if (p.seed == LLAMA_DEFAULT_SEED) {
        return {"seed", "seed 4294967295 means a random seed to llama.cpp, which no replay can repeat: choose another"};
    }
    return {};
}

void sampling_check(const sampling_params & p, int32_t n_vocab, int32_t max_penalty_last_n) {
    const sampling_problem problem = sampling_find_problem(p, n_vocab, max_penalty_last_n);
    if (!problem.field.empty()) {
        bad(problem.message);
    }
}

token_sampler::token_sampler(int32_t n_vocab, const sampling_params & p, int32_t max_penalty_last_n)
    : n_vocab_(n_vocab), params_(p) {
    sampling_check(p, n_vocab, max_penalty_last_n);
    chain_ = llama_sampler_chain_init(llama_sampler_chain_default_params());
    llama_sampler_chain_add(chain_, llama_sampler_init_penalties(n_vocab, p.penalty_last_n, p.penalty_repeat, p.penalty_freq,
                                                                 p.penalty_present));
    llama_sampler_chain_add(chain_, llama_sampler_init_top_k(p.top_k));
    llama_sampler_chain_add(chain_, llama_sampler_init_top_p(p.top_p, 1));
    llama_sampler_chain_add(chain_, llama_sampler_init_min_p(p.min_p, 1));
    llama_sampler_chain_add(chain_, llama_sampler_init_temp(p.temperature));
    llama_sampler_chain_add(chain_, llama_sampler_init_dist(p.seed));
    candidates_.resize((size_t) n_vocab);
    argmax_only_ = p.temperature == 0.0f && p.top_k == 0 && p.top_p >= 1.0f && p.min_p == 0.0f;
}

token_sampler token_sampler::resume(int32_t n_vocab, const sampling_params & p, int32_t max_penalty_last_n,
                                    const std::vector<int32_t> & history, uint64_t draws) {
    // a session holds at most HOT_KV_MAX_CONTEXT_TOKENS tokens, each sampled at most once: more is
    // not a session's state (and replaying 2^60 draws would hold the caller for ever)
    if (history.size() > (size_t) HOT_KV_MAX_CONTEXT_TOKENS || draws > (uint64_t) HOT_KV_MAX_CONTEXT_TOKENS) {
        bad("a history of " + std::to_string(history.size()) + " tokens and " + std::to_string(draws) +
            " draws: a session holds at most " + std::to_string(HOT_KV_MAX_CONTEXT_TOKENS));
    }
    token_sampler s(n_vocab, p, max_penalty_last_n);
    for (int32_t t : history) {
        s.accept(t);
    }
    // dist draws once per apply whatever the row (one candidate is enough); the other samplers keep
    // no state between applies, so this moves the generator and nothing else
    llama_token_data one{0, 0.0f, 0.0f};
    for (uint64_t i = 0; i < draws; ++i) {
        llama_token_data_array row{&one, 1, -1, false};
        one = llama_token_data{0, 0.0f, 0.0f};
        llama_sampler_apply(s.chain_, &row);
    }
    s.draws_ = draws;
    return s;
}

token_sampler::~token_sampler() {
    if (chain_ != nullptr) {
        llama_sampler_free(chain_);
    }
}

token_sampler::token_sampler(token_sampler && o) noexcept
    : n_vocab_(o.n_vocab_), params_(o.params_), chain_(std::exchange(o.chain_, nullptr)), draws_(o.draws_),
      candidates_(std::move(o.candidates_)), argmax_only_(o.argmax_only_), window_(std::move(o.window_)),
      row_(std::move(o.row_)), counted_(std::move(o.counted_)) {}

token_sampler & token_sampler::operator=(token_sampler && o) noexcept {
    if (this != &o) {
        if (chain_ != nullptr) {
            llama_sampler_free(chain_);
        }
        n_vocab_ = o.n_vocab_;
        params_ = o.params_;
        chain_ = std::exchange(o.chain_, nullptr);
        draws_ = o.draws_;
        candidates_ = std::move(o.candidates_);
        argmax_only_ = o.argmax_only_;
        window_ = std::move(o.window_);
        row_ = std::move(o.row_);
        counted_ = std::move(o.counted_);
    }
    return *this;
}

int32_t token_sampler::sample(const float * logits, size_t n) {
    if (logits == nullptr || n != (size_t) n_vocab_) {
        bad("a row of " + std::to_string(n) + " logits for a vocabulary of " + std::to_string(n_vocab_));
    }
    for (size_t i = 0; i < n; ++i) {
        if (!std::isfinite(logits[i])) {
            bad("logit " + std::to_string(i) + " is not finite");
        }
    }
    if (argmax_only_) {
        const int32_t token = sample_argmax(logits);
        if (token >= 0) {
            return token;
        }
    }
    for (int32_t i = 0; i < n_vocab_; ++i) {
        candidates_[(size_t) i] = llama_token_data{i, logits[i], 0.0f};
    }
    llama_token_data_array row{candidates_.data(), candidates_.size(), -1, false};
    llama_sampler_apply(chain_, &row);
    draws_++;
    if (row.selected < 0 || (size_t) row.selected >= row.size) {
        // cannot happen with a checked chain over finite logits (dist always selects)
        throw shard_error(SHARD_ERRC_COMPUTE, "sampling: the chain selected no token");
    }
    return row.data[row.selected].id;
}

// -1: undecided (the caller runs the whole row)
int32_t token_sampler::sample_argmax(const float * logits) {
    // the penalties change only the logits of the tokens they count: apply llama.cpp's own
    // penalties sampler (the chain's first) to those alone (a token it does not count is unchanged)
    const float * row = logits;
    if (!window_.empty()) {
        counted_.clear();
        for (int32_t t : window_) {
            counted_.push_back(llama_token_data{t, logits[t], 0.0f});
        }
        llama_token_data_array small{counted_.data(), counted_.size(), -1, false};
        llama_sampler_apply(llama_sampler_chain_get(chain_, 0), &small);
        row_.assign(logits, logits + n_vocab_);
        for (const auto & c : counted_) {
            if (!std::isfinite(c.logit)) {
                return -1;  // a penalty overflowed (|logit| near FLT_MAX): the whole row decides, as stock
            }
            row_[(size_t) c.id] = c.logit;
        }
        row = row_.data();
    }
    int32_t best = 0;  // the first of equals, as llama.cpp's temperature 0 keeps it
    for (int32_t i = 1; i < n_vocab_; ++i) {
        if (row[i] > row[best]) {
            best = i;
        }
    }
    // the chain on token 0 (masked) and the winner: dist draws once and, on a draw of exactly 0,
    // selects the first candidate, token 0, as it does from the whole row
    // (the winner's logit here is any finite value: the chain penalises it again, harmlessly)
    llama_token_data two[2] = {{0, -INFINITY, 0.0f}, {best, 0.0f, 0.0f}};
    llama_token_data_array pair{best == 0 ? two + 1 : two, best == 0 ? 1u : 2u, -1, false};
    llama_sampler_apply(chain_, &pair);
    draws_++;
    if (pair.selected < 0 || (size_t) pair.selected >= pair.size) {
        throw shard_error(SHARD_ERRC_COMPUTE, "sampling: the chain selected no token");
    }
    return pair.data[pair.selected].id;
}

void token_sampler::accept(int32_t token) {
    if (token < 0 || token >= n_vocab_) {
        bad("token " + std::to_string(token) + " is outside the vocabulary [0, " + std::to_string(n_vocab_) + ")");
    }
    llama_sampler_accept(chain_, token);
    if (argmax_only_ && !penalties_off()) {
        if (window_.size() == (size_t) params_.penalty_last_n) {
            window_.pop_front();
        }
        window_.push_back(token);
    }
}

} // namespace llama_shard
