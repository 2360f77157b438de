#include "llama_shard/token_sampler.h"

#include "llama_shard/hot_kv_limits.h"
#include "llama_shard/shard_error.h"

#include "llama.h"

#include <algorithm>
#include <string>
#include <cmath>
#include <utility>

namespace llama_shard {

static void bad(const std::string & what) {
    throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "sampling: " + what);
}

static bool within(float v, float lo, float hi) {
    return std::isfinite(v) && v >= lo && v <= hi;
}

// the end of a "..." literal or a [...] class that starts at `i` (its closing character; the
// text's end when it has none: the parser refuses that)
static size_t skip_quoted(const std::string & g, size_t i, char close) {
    for (++i; i < g.size(); ++i) {
        if (g[i] == '\\') {
            ++i;
        } else if (g[i] == close) {
            return i;
        }
    }
    return g.size();
}

// a repetition's count at `i`: 1 to 4 digits (llama.cpp refuses a least over 2000 and reads a
// most over 2000 as unbounded: 4 digits hold every count it takes)
static bool count_at(const std::string & g, size_t & i, uint64_t & value) {
    const size_t start = i;
    value = 0;
    while (i < g.size() && g[i] >= '0' && g[i] <= '9') {
        if (i - start == 4) {
            return false;
        }
        value = value * 10 + (uint64_t) (g[i] - '0');
        ++i;
    }
    return i > start;
}

static void skip_spaces(const std::string & g, size_t & i) {
    while (i < g.size() && (g[i] == ' ' || g[i] == '\t')) {
        ++i;
    }
}

// The text is read as llama.cpp's parser reads it (src/llama-grammar.cpp): "..." literals and
// [...] classes with their escapes, <...> tokens, comments from # to the end of a line (\r or
// \n). Stricter than the parser where that is safer: a repetition is exactly {m}, {m,} or {m,n}
// on one line with counts of at most 4 digits (a comment or a newline inside one, or a longer
// count, would hide a least over the most from a looser reading).
std::string grammar_text_problem(const std::string & g) {
    if (g.size() > SAMPLING_MAX_GRAMMAR_BYTES) {
        return "the grammar is " + std::to_string(g.size()) + " bytes; at most " + std::to_string(SAMPLING_MAX_GRAMMAR_BYTES);
    }
    if (g.find('\0') != std::string::npos) {
        return "the grammar holds a NUL byte";
    }
    int depth = 0;
    int rules = 0;
    for (size_t i = 0; i < g.size(); ++i) {
        const char c = g[i];
        if (c == '"' || c == '[') {
            i = skip_quoted(g, i, c == '"' ? '"' : ']');
        } else if (c == '<') {
            const size_t end = g.find('>', i + 1);
            i = end == std::string::npos ? g.size() : end;
        } else if (c == '#') {
            while (i < g.size() && g[i] != '\n' && g[i] != '\r') {
                ++i;
            }
        } else if (c == '(') {
            if (++depth > SAMPLING_MAX_GRAMMAR_NESTING) {
                return "the grammar nests parentheses deeper than " + std::to_string(SAMPLING_MAX_GRAMMAR_NESTING);
            }
        } else if (c == ')') {
            depth = std::max(0, depth - 1);
        } else if (c == ':' && g.compare(i, 3, "::=") == 0) {
            if (++rules > SAMPLING_MAX_GRAMMAR_RULES) {
                return "the grammar has more than " + std::to_string(SAMPLING_MAX_GRAMMAR_RULES) + " rules";
            }
        } else if (c == '{') {
            // llama.cpp builds max - min optional copies, which wraps around to 2^64 when m > n
            const std::string form = "a repetition is {m}, {m,} or {m,n} on one line, with counts of at most 4 digits";
            size_t j = i + 1;
            uint64_t lo = 0, hi = 0;
            skip_spaces(g, j);
            if (!count_at(g, j, lo)) {
                return form;
            }
            skip_spaces(g, j);
            bool has_hi = false;
            if (j < g.size() && g[j] == ',') {
                ++j;
                skip_spaces(g, j);
                if (j < g.size() && g[j] >= '0' && g[j] <= '9') {
                    if (!count_at(g, j, hi)) {
                        return form;
                    }
                    has_hi = true;
                    skip_spaces(g, j);
                }
            }
            if (j >= g.size() || g[j] != '}') {
                return form;
            }
            if (has_hi && hi < lo) {
                return "the grammar repeats {" + std::to_string(lo) + "," + std::to_string(hi) +
                       "}: the least is more than the most";
            }
            i = j;
        }
    }
    return {};
}

std::string grammar_problem(const llama_vocab * vocab, const std::string & grammar) {
    std::string problem = grammar_text_problem(grammar);
    if (!problem.empty() || grammar.empty()) {
        return problem;
    }
    if (vocab == nullptr) {
        return "a grammar needs the model's vocabulary";
    }
    if (llama_vocab_type(vocab) == LLAMA_VOCAB_TYPE_NONE) {  // llama.cpp would index its empty token texts
        return "this model has no tokenizer: a grammar matches the texts of its tokens";
    }
    llama_sampler * s = llama_sampler_init_grammar(vocab, grammar.c_str(), "root");
    if (s == nullptr) {
        return "llama.cpp's grammar parser refuses it (GBNF with a `root` rule, no left recursion, at most 4096 "
               "parse stacks at the start; its log says where)";
    }
    llama_sampler_free(s);
    return {};
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
    if (p.logit_bias.size() > SAMPLING_MAX_LOGIT_BIAS) {
        return {"logit_bias", "logit_bias takes at most " + std::to_string(SAMPLING_MAX_LOGIT_BIAS) + " tokens, got " +
                                  std::to_string(p.logit_bias.size())};
    }
    std::vector<int32_t> biased;
    biased.reserve(p.logit_bias.size());
    for (const token_bias & b : p.logit_bias) {
        if (b.token < 0 || b.token >= n_vocab) {
            return {"logit_bias", "logit_bias: token " + std::to_string(b.token) + " is outside the vocabulary [0, " +
                                      std::to_string(n_vocab) + ")"};
        }
        if (!within(b.bias, -SAMPLING_MAX_BIAS, SAMPLING_MAX_BIAS)) {
            return {"logit_bias", "logit_bias: token " + std::to_string(b.token) + "'s bias must be in [-100, 100], got " +
                                      std::to_string(b.bias)};
        }
        biased.push_back(b.token);
    }
    std::sort(biased.begin(), biased.end());
    if (std::adjacent_find(biased.begin(), biased.end()) != biased.end()) {
        return {"logit_bias", "logit_bias names a token twice"};
    }
    if (std::string why = grammar_text_problem(p.grammar); !why.empty()) {
        return {"grammar", "grammar: " + why};
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

token_sampler::token_sampler(int32_t n_vocab, const sampling_params & p, int32_t max_penalty_last_n,
                             const llama_vocab * vocab)
    : n_vocab_(n_vocab), params_(p) {
    sampling_check(p, n_vocab, max_penalty_last_n);
    if (!p.grammar.empty()) {
        if (vocab == nullptr || llama_vocab_n_tokens(vocab) != n_vocab) {
            bad("a grammar needs the vocabulary of the model's " + std::to_string(n_vocab) + " tokens");
        }
        if (llama_vocab_type(vocab) == LLAMA_VOCAB_TYPE_NONE) {
            bad("grammar: this model has no tokenizer: a grammar matches the texts of its tokens");
        }
        grammar_ = llama_sampler_init_grammar(vocab, p.grammar.c_str(), "root");
        if (grammar_ == nullptr) {
            bad("grammar: llama.cpp's grammar parser refuses it (GBNF with a `root` rule, no left recursion, at "
                "most 4096 parse stacks at the start)");
        }
    }
    chain_ = llama_sampler_chain_init(llama_sampler_chain_default_params());
    if (!p.logit_bias.empty()) {  // first, as stock puts it: the penalties and truncations see the biased logits
        std::vector<llama_logit_bias> biases;
        biases.reserve(p.logit_bias.size());
        for (const token_bias & b : p.logit_bias) {
            biases.push_back(llama_logit_bias{b.token, b.bias});
        }
        llama_sampler_chain_add(chain_, llama_sampler_init_logit_bias(n_vocab, (int32_t) biases.size(), biases.data()));
    }
    llama_sampler_chain_add(chain_, llama_sampler_init_penalties(n_vocab, p.penalty_last_n, p.penalty_repeat, p.penalty_freq,
                                                                 p.penalty_present));
    llama_sampler_chain_add(chain_, llama_sampler_init_top_k(p.top_k));
    llama_sampler_chain_add(chain_, llama_sampler_init_top_p(p.top_p, 1));
    llama_sampler_chain_add(chain_, llama_sampler_init_min_p(p.min_p, 1));
    llama_sampler_chain_add(chain_, llama_sampler_init_temp(p.temperature));
    llama_sampler_chain_add(chain_, llama_sampler_init_dist(p.seed));
    candidates_.resize((size_t) n_vocab);
    argmax_only_ = p.temperature == 0.0f && p.top_k == 0 && p.top_p >= 1.0f && p.min_p == 0.0f && p.logit_bias.empty();
}

token_sampler token_sampler::resume(int32_t n_vocab, const sampling_params & p, int32_t max_penalty_last_n,
                                    const std::vector<int32_t> & history, uint64_t draws,
                                    const llama_vocab * vocab, const std::vector<int32_t> & generated) {
    // a session holds at most HOT_KV_MAX_CONTEXT_TOKENS tokens, each sampled at most once: more is
    // not a session's state (and replaying 2^60 draws would hold the caller for ever)
    if (history.size() > (size_t) HOT_KV_MAX_CONTEXT_TOKENS || draws > (uint64_t) HOT_KV_MAX_CONTEXT_TOKENS) {
        bad("a history of " + std::to_string(history.size()) + " tokens and " + std::to_string(draws) +
            " draws: a session holds at most " + std::to_string(HOT_KV_MAX_CONTEXT_TOKENS));
    }
    if (!p.grammar.empty() && generated.size() != draws) {
        bad("a grammar replays every sampled token: " + std::to_string(generated.size()) + " given for " +
            std::to_string(draws) + " draws");
    }
    token_sampler s(n_vocab, p, max_penalty_last_n, vocab);
    for (int32_t t : history) {
        s.accept(t);
    }
    if (s.grammar_ != nullptr) {
        for (int32_t t : generated) {
            s.advance_grammar(t);
        }
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
    if (grammar_ != nullptr) {
        llama_sampler_free(grammar_);
    }
}

token_sampler::token_sampler(token_sampler && o) noexcept
    : n_vocab_(o.n_vocab_), params_(o.params_), chain_(std::exchange(o.chain_, nullptr)),
      grammar_(std::exchange(o.grammar_, nullptr)), grammar_broken_(o.grammar_broken_), draws_(o.draws_),
      candidates_(std::move(o.candidates_)), argmax_only_(o.argmax_only_), window_(std::move(o.window_)),
      row_(std::move(o.row_)), counted_(std::move(o.counted_)) {}

token_sampler & token_sampler::operator=(token_sampler && o) noexcept {
    if (this != &o) {
        if (chain_ != nullptr) {
            llama_sampler_free(chain_);
        }
        if (grammar_ != nullptr) {
            llama_sampler_free(grammar_);
        }
        n_vocab_ = o.n_vocab_;
        params_ = o.params_;
        chain_ = std::exchange(o.chain_, nullptr);
        grammar_ = std::exchange(o.grammar_, nullptr);
        grammar_broken_ = o.grammar_broken_;
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
    if (grammar_broken_) {  // its empty stacks would abort llama.cpp's apply
        bad("the grammar's state was lost to an earlier failure: rebuild the sampler");
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
    if (grammar_ != nullptr) {
        apply_grammar(&row);
        const bool any = std::any_of(candidates_.begin(), candidates_.end(),
                                     [](const llama_token_data & c) { return std::isfinite(c.logit); });
        if (!any) {  // the chain would draw from nothing (stock asserts there)
            bad("the grammar allows no token of the vocabulary here");
        }
    }
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
        llama_sampler_apply(llama_sampler_chain_get(chain_, 0), &small);  // no logit bias here: 0 is the penalties
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
    if (grammar_ != nullptr && !grammar_allows(best)) {
        return -1;  // the masked row decides (the first of the largest allowed logits)
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

void token_sampler::apply_grammar(llama_token_data_array * row) {
    try {
        llama_sampler_apply(grammar_, row);  // sets a refused token's logit to -inf; changes no state
    } catch (const std::exception & e) {
        // patch 0009: an ambiguous grammar's stacks past the bound. The state is intact but every
        // later mask would throw the same: the stream ends here
        grammar_broken_ = true;
        bad(e.what());  // "grammar: more than ..."
    }
}

bool token_sampler::grammar_allows(int32_t token) {
    llama_token_data one{token, 0.0f, 0.0f};
    llama_token_data_array row{&one, 1, -1, false};
    apply_grammar(&row);
    return std::isfinite(one.logit);
}

void token_sampler::advance_grammar(int32_t token) {
    if (token < 0 || token >= n_vocab_) {
        bad("token " + std::to_string(token) + " is outside the vocabulary [0, " + std::to_string(n_vocab_) + ")");
    }
    // llama.cpp's accept throws for a token its stacks do not allow (and leaves them empty) and
    // aborts for an end-of-generation token before the grammar is complete: asked first
    if (grammar_broken_) {
        bad("the grammar's state was lost to an earlier failure: rebuild the sampler");
    }
    if (!grammar_allows(token)) {
        bad("token " + std::to_string(token) + " does not fit the grammar here");
    }
    try {
        llama_sampler_accept(grammar_, token);
    } catch (const std::exception & e) {
        // after grammar_allows only patch 0009's bound: the stacks past 4096 part-way through the
        // token's characters (the state is half advanced then): the caller's grammar, a bad input
        grammar_broken_ = true;
        bad("the grammar failed on token " + std::to_string(token) + ": " + e.what());
    }
}

void token_sampler::accept_sampled(int32_t token) {
    if (grammar_ != nullptr) {
        advance_grammar(token);
    }
    accept(token);
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
