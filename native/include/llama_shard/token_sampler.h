#pragma once

// token_sampler: one session's sampler, llama.cpp's own samplers chained in stock llama.cpp's order
// (common/sampling.cpp): logit_bias -> penalties -> top_k -> top_p -> min_p -> temperature -> dist(seed),
// after llama.cpp's grammar sampler where the params carry a grammar (GBNF).
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
//  - with a grammar: the grammar masks the row before the chain (common_sampler_sample with
//    grammar_first: one draw per token, so the state stays (params, tokens, draws, and the tokens
//    generated, which the grammar replays)); accept() takes only a token the grammar allows (it
//    checks first: llama.cpp's grammar throws, or aborts on an end-of-generation token, otherwise),
//    and a grammar text is checked for what llama.cpp's parser would crash or hang on (nesting,
//    size, a repetition {m,n} with m > n) before the parser sees it. At temperature 0 the argmax
//    is tried first and the row masked only when the grammar refuses it: the same token (the
//    largest allowed logit, the first of equals) without matching every token of the vocabulary.
// temperature 0 is stock's: the largest (penalised) logit, the first of equals; it still draws.
// With temperature 0, no logit bias and top_k, top_p and min_p off (what an OpenAI request with
// temperature 0 asks for), sample() finds that token without running the chain over the whole row: the
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
struct llama_token_data_array;
struct llama_vocab;

namespace llama_shard {

// one token's logit bias (OpenAI's logit_bias: added to the token's logit before anything else)
struct token_bias {
    int32_t token = 0;
    float   bias  = 0.0f;
};

// the most biased tokens one request may give, and the largest |bias| (OpenAI's range)
constexpr size_t SAMPLING_MAX_LOGIT_BIAS = 1024;
constexpr float  SAMPLING_MAX_BIAS       = 100.0f;
// a grammar's bounds: its text, the depth of its parentheses (llama.cpp's parser recurses per
// level, unbounded) and its rules (its left-recursion check recurses per rule)
constexpr size_t SAMPLING_MAX_GRAMMAR_BYTES   = 64 * 1024;
constexpr int    SAMPLING_MAX_GRAMMAR_NESTING = 64;
constexpr int    SAMPLING_MAX_GRAMMAR_RULES   = 2048;

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
    std::vector<token_bias> logit_bias;  // distinct tokens of the vocabulary, |bias| <= 100; empty: off
    std::string grammar;                 // GBNF whose start is `root` (llama.cpp's grammar sampler); empty: none
};

// what makes a grammar text unsafe for llama.cpp's parser (too long, nested too deep, too many
// rules, a repetition {m,n} with m > n, a NUL byte); "" when none. Not a parse: grammar_problem parses.
std::string grammar_text_problem(const std::string & grammar);
// grammar_text_problem's answer, else llama.cpp's parser's refusal over `vocab`; "" when it parses
std::string grammar_problem(const llama_vocab * vocab, const std::string & grammar);

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
    // checks `p` (sampling_check) and builds the chain; no token accepted, no draw made. A grammar
    // needs the vocabulary its tokens come from (`vocab`; else INVALID_ARGUMENT)
    token_sampler(int32_t n_vocab, const sampling_params & p, int32_t max_penalty_last_n,
                  const llama_vocab * vocab = nullptr);
    // the sampler that accepted `history` (the prompt, then every sampled token) and drew `draws`
    // times; with a grammar, `generated` is every token sampled (draws of them), which it replays
    static token_sampler resume(int32_t n_vocab, const sampling_params & p, int32_t max_penalty_last_n,
                                const std::vector<int32_t> & history, uint64_t draws,
                                const llama_vocab * vocab = nullptr, const std::vector<int32_t> & generated = {});
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
    // a sampled token: the grammar (if any) advances over it, then accept(); INVALID_ARGUMENT, and
    // nothing changed, for a token the grammar does not allow here
    void accept_sampled(int32_t token);

    uint64_t                draws() const { return draws_; }
    const sampling_params & params() const { return params_; }

private:
    int32_t sample_argmax(const float * logits);  // the argmax_only_ path of sample(), logits checked; -1: undecided
    bool    grammar_allows(int32_t token);         // the grammar's verdict on one token, its state unchanged
    void    apply_grammar(::llama_token_data_array * row);  // the grammar's mask (patch 0009's bound: bad())
    void    advance_grammar(int32_t token);        // the grammar over one token it allows (else INVALID_ARGUMENT)
    bool    penalties_off() const {  // llama.cpp's own test (llama_sampler_penalties::is_disabled)
        return params_.penalty_last_n == 0 ||
               (params_.penalty_repeat == 1.0f && params_.penalty_freq == 0.0f && params_.penalty_present == 0.0f);
    }

    int32_t                       n_vocab_;
    sampling_params               params_;
    llama_sampler *               chain_ = nullptr;
    llama_sampler *               grammar_ = nullptr;  // outside the chain, as stock keeps it; null: none
    bool                          grammar_broken_ = false;  // llama.cpp threw mid-accept: its stacks are empty
    uint64_t                      draws_ = 0;
    std::vector<::llama_token_data> candidates_;  // reused: one row's worth
    bool                          argmax_only_ = false;  // temperature 0, no top_k/top_p/min_p
    std::deque<int32_t>           window_;      // the last penalty_last_n accepted tokens (argmax_only_)
    std::vector<float>            row_;         // reused by the argmax path: the penalised row
    std::vector<::llama_token_data> counted_;   // reused by the argmax path: the window's tokens
};

} // namespace llama_shard
