// stock_sample: stock llama.cpp's own sampler (common_sampler, as llama-server and llama-completion
// use it) on the whole model, from the pinned source. The anchor of benchmarks/stock_sampling.py:
// a route's seeded Generate must give exactly these tokens.
//
//   stock_sample MODEL N_GEN SEED TEMP TOP_K TOP_P MIN_P PENALTY_LAST_N REPEAT FREQ PRESENT TOKEN...
//
// The chain is penalties -> top_k -> top_p -> min_p -> temperature -> dist(SEED) (the other stock
// samplers are off at their defaults and left out); the prompt's tokens are accepted first, as
// llama-completion and llama-server do. TEMP < 0: greedy (the argmax, no sampler). One thread, so
// the logits equal a 1-thread worker's. Prints the generated token ids on one line.
#include "common.h"
#include "llama.h"
#include "sampling.h"

#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char ** argv) {
    if (argc < 13) {
        fprintf(stderr, "usage: %s MODEL N_GEN SEED TEMP TOP_K TOP_P MIN_P PENALTY_LAST_N REPEAT FREQ PRESENT TOKEN...\n",
                argv[0]);
        return 2;
    }
    const int n_gen = atoi(argv[2]);
    common_params_sampling sp;
    sp.seed            = (uint32_t) strtoul(argv[3], nullptr, 10);
    sp.temp            = (float) atof(argv[4]);
    sp.top_k           = atoi(argv[5]);
    sp.top_p           = (float) atof(argv[6]);
    sp.min_p           = (float) atof(argv[7]);
    sp.penalty_last_n  = atoi(argv[8]);
    sp.penalty_repeat  = (float) atof(argv[9]);
    sp.penalty_freq    = (float) atof(argv[10]);
    sp.penalty_present = (float) atof(argv[11]);
    sp.samplers = { COMMON_SAMPLER_TYPE_PENALTIES, COMMON_SAMPLER_TYPE_TOP_K, COMMON_SAMPLER_TYPE_TOP_P,
                    COMMON_SAMPLER_TYPE_MIN_P, COMMON_SAMPLER_TYPE_TEMPERATURE };
    const bool greedy = sp.temp < 0;
    std::vector<llama_token> prompt;
    for (int i = 12; i < argc; i++) {
        prompt.push_back(atoi(argv[i]));
    }

    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (model == nullptr) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512;
    cp.n_batch = 512;
    cp.n_threads = cp.n_threads_batch = 1;
    llama_context * ctx = llama_init_from_model(model, cp);
    common_sampler * smpl = greedy ? nullptr : common_sampler_init(model, sp);
    for (llama_token t : prompt) {
        common_sampler_accept(smpl, t, false);
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::vector<llama_token> input = prompt;
    for (int i = 0; i < n_gen; i++) {
        if (llama_decode(ctx, llama_batch_get_one(input.data(), (int32_t) input.size())) != 0) {
            fprintf(stderr, "llama_decode failed\n");
            return 1;
        }
        llama_token id;
        if (greedy) {
            const float * logits = llama_get_logits_ith(ctx, -1);
            id = 0;
            for (int v = 1; v < n_vocab; v++) {
                if (logits[v] > logits[id]) {
                    id = v;
                }
            }
        } else {
            id = common_sampler_sample(smpl, ctx, -1);
            common_sampler_accept(smpl, id, true);
        }
        printf("%s%d", i ? " " : "", id);
        input.assign(1, id);
    }
    printf("\n");
    common_sampler_free(smpl);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
