#pragma once

// token_sampler: one session's sampler, llama.cpp's own samplers chained in stock llama.cpp's order
// (common/sampling.cpp): penalties -> top_k -> top_p -> min_p -> temperature -> dist(seed).
//
// Invariants:
//  - the state is a function of (params, the tokens accepted, the number of draws): llama.cpp's
//    penalties remember the last penalty_last_n accepted tokens, and dist draws exactly one number
//    from its mt19937 per sample (src/llama-sampler.cpp llama_sampler_dist_apply). resume() rebuilds
//    a sampler from those three, so a retried step, or a session re-prefilled after a cache miss,
//    samples exactly the token it would have sampled;
//  - every parameter is checked before llama.cpp sees it (sampling_check): llama.cpp checks none of
//    them, and a NaN temperature, a zero repeat penalty or a huge window silently pick the last
//    token or throw from an allocation;
//  - sample() takes a whole row of n_vocab finite logits and returns a token in [0, n_vocab); it
//    does not accept it (stock: common_sampler_sample, then common_sampler_accept).
// temperature 0 is stock's: the largest (penalised) logit, the first of equals; it still draws.
// With temperature 0 and top_k, top_p and min_p off (what an OpenAI request with temperature 0
// asks for), sample() finds that token without running the chain over the whole row: the
// penalties sampler adjusts only the tokens of its window, the first largest logit wins, and the
// chain then runs on a row of two candidates (token 0, masked, and the winner) so that dist draws
// its one number and, if that number is exactly 0, picks token 0 as it would from the whole row.
// The same token, the same generator state, at a fifth of the cost (101 against 567 us on a
// 49,152-token row). A penalty that overflows a logit to infinity (|logit| near FLT_MAX) sends the
// row to the whole chain, so stock's behaviour holds there too.

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

struct llama_sampler;
struct llama_token_data;

namespace llama_shard {

// neutral defaults: every sampler but dist off (the chain then samples the model's distribution)
struct sampling_params {
    float    temperature     = 1.0f;  // 0 (the largest logit) or in [SAMPLING_MIN_TEMPERATURE, 100]
    int32_t  top_k           = 0;     // 0: off; else 1..n_vocab
    float    top_p           = 1.0f;  // (0, 1]; 1: off
    float    min_p           = 0.0f;  // [0, 1]; 0: off
    int32_t  penalty_last_n  = 64;    // the window of accepted tokens the penalties see; 0: off
    float    penalty_repeat  = 1.0f;  // [0.01, 100]; 1: off
    float    penalty_freq    = 0.0f;  // [-100, 100]; 0: off
    float    penalty_present = 0.0f;  // [-100, 100]; 0: off
    uint32_t seed            = 0;     // any but 0xFFFFFFFF (llama.cpp's "random", which no replay repeats)
};

constexpr float SAMPLING_MIN_TEMPERATURE = 1e-3f;

// the first parameter outside its range: its field name (sampling_params' member) and why; an
// empty field when every one is in range. The one statement of the ranges: every entry point
// (CLI flags, the wire, the OpenAI endpoint) asks this. max_penalty_last_n bounds the window (a
// context's length: a longer window sees nothing more)
struct sampling_problem {
    std::string field;
    std::string message;
};
sampling_problem sampling_find_problem(const sampling_params & p, int32_t n_vocab, int32_t max_penalty_last_n);

// throws shard_error(SHARD_ERRC_INVALID_ARGUMENT) with sampling_find_problem's message
void sampling_check(const sampling_params & p, int32_t n_vocab, int32_t max_penalty_last_n);

class token_sampler {
public:
    // checks `p` (sampling_check) and builds the chain; no token accepted, no draw made
    token_sampler(int32_t n_vocab, const sampling_params & p, int32_t max_penalty_last_n);
    // the sampler that accepted `history` (the prompt, then every sampled token) and drew `draws` times
    static token_sampler resume(int32_t n_vocab, const sampling_params & p, int32_t max_penalty_last_n,
                                const std::vector<int32_t> & history, uint64_t draws);
    ~token_sampler();
    token_sampler(token_sampler && other) noexcept;
    token_sampler & operator=(token_sampler && other) noexcept;
    token_sampler(const token_sampler &) = delete;
    token_sampler & operator=(const token_sampler &) = delete;

    // one draw over a row of n_vocab logits; throws shard_error(INVALID_ARGUMENT) for a row of
    // another length or with a NaN or infinite logit, and then changes nothing
    int32_t sample(const float * logits, size_t n);
    // the penalties remember `token` (a prompt token, or the token sample() returned)
    void accept(int32_t token);

    uint64_t                draws() const { return draws_; }
    const sampling_params & params() const { return params_; }

private:
    int32_t sample_argmax(const float * logits);  // the argmax_only_ path of sample(), logits checked; -1: undecided
    bool    penalties_off() const {  // llama.cpp's own test (llama_sampler_penalties::is_disabled)
        return params_.penalty_last_n == 0 ||
               (params_.penalty_repeat == 1.0f && params_.penalty_freq == 0.0f && params_.penalty_present == 0.0f);
    }

    int32_t                       n_vocab_;
    sampling_params               params_;
    llama_sampler *               chain_ = nullptr;
    uint64_t                      draws_ = 0;
    std::vector<::llama_token_data> candidates_;  // reused: one row's worth
    bool                          argmax_only_ = false;  // temperature 0, no top_k/top_p/min_p
    std::deque<int32_t>           window_;      // the last penalty_last_n accepted tokens (argmax_only_)
    std::vector<float>            row_;         // reused by the argmax path: the penalised row
    std::vector<::llama_token_data> counted_;   // reused by the argmax path: the window's tokens
};

} // namespace llama_shard
