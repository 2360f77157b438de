// Bad input never aborts and never changes state: every case throws shard_error with the right
// code, and afterwards the context still holds exactly what it held and computes the same bits.

#include "llama_shard/cpu_backend.h"
#include "llama_shard/shard_context.h"
#include "test-common.h"

#include "llama.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

using namespace llama_shard;

namespace {

shard_model_params params_for(const std::string & path, int first = -1, int last = -1) {
    shard_model_params mp;
    mp.path = path;
    mp.n_threads = 2;
    if (first != -1 || last != -1) {
        mp.layers = std::make_pair(first, last);
    }
    return mp;
}

void write_bytes(const std::string & path, const std::vector<char> & bytes) {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), (std::streamsize) bytes.size());
}

std::vector<char> read_bytes(const std::string & path) {
    std::ifstream f(path, std::ios::binary);
    return std::vector<char>(std::istreambuf_iterator<char>(f), {});
}

void check_model_loading(const std::string & model, const std::string & gpt2, const std::string & scratch) {
    const std::vector<char> bytes = read_bytes(model);
    CHECK(!bytes.empty());

    CHECK_THROWS(shard_model(params_for(scratch + "/does-not-exist.gguf")), SHARD_ERRC_MODEL_LOAD);
    CHECK_THROWS(shard_model(params_for(scratch)), SHARD_ERRC_MODEL_LOAD);  // a directory

    write_bytes(scratch + "/truncated-header.gguf", std::vector<char>(bytes.begin(), bytes.begin() + 64));
    CHECK_THROWS(shard_model(params_for(scratch + "/truncated-header.gguf")), SHARD_ERRC_MODEL_LOAD);

    write_bytes(scratch + "/truncated-data.gguf", std::vector<char>(bytes.begin(), bytes.begin() + (long) bytes.size() / 2));
    CHECK_THROWS(shard_model(params_for(scratch + "/truncated-data.gguf")), SHARD_ERRC_MODEL_LOAD);
    CHECK_THROWS(shard_model(params_for(scratch + "/truncated-data.gguf", 0, 1)), SHARD_ERRC_MODEL_LOAD);

    std::vector<char> garbage(4096);
    for (size_t i = 0; i < garbage.size(); ++i) {
        garbage[i] = (char) ((i * 2654435761u) >> 13);
    }
    write_bytes(scratch + "/garbage.gguf", garbage);
    CHECK_THROWS(shard_model(params_for(scratch + "/garbage.gguf")), SHARD_ERRC_MODEL_LOAD);

    std::vector<char> bad_magic = bytes;
    std::memcpy(bad_magic.data(), "GGUX", 4);
    write_bytes(scratch + "/bad-magic.gguf", bad_magic);
    CHECK_THROWS(shard_model(params_for(scratch + "/bad-magic.gguf")), SHARD_ERRC_MODEL_LOAD);

    CHECK_THROWS(shard_model(params_for(gpt2, 0, 0)), SHARD_ERRC_UNSUPPORTED_ARCHITECTURE);

    const int L = shard_model(params_for(model)).info().n_layer;
    CHECK_THROWS(shard_model(params_for(model, 0, L)), SHARD_ERRC_INVALID_ARGUMENT);
    CHECK_THROWS(shard_model(params_for(model, 3, 2)), SHARD_ERRC_INVALID_ARGUMENT);
    CHECK_THROWS(shard_model(params_for(model, -2, 2)), SHARD_ERRC_INVALID_ARGUMENT);
    CHECK_THROWS(shard_model(params_for(model, L, L)), SHARD_ERRC_INVALID_ARGUMENT);

    // the patch's own gate, bypassing the engine's pre-validation: llama.cpp refuses, no abort
    shard_backend_init();
    llama_model_params mparams = llama_model_default_params();
    mparams.shard_layer_first = 2;
    mparams.shard_layer_last  = L;
    CHECK(llama_model_load_from_file(model.c_str(), mparams) == nullptr);
    mparams.shard_layer_first = 0;
    mparams.shard_layer_last  = 0;
    llama_model * ok = llama_model_load_from_file(model.c_str(), mparams);
    CHECK(ok != nullptr);
    if (ok) {
        llama_model_free(ok);
    }
}

struct fixture {
    shard_model   model;
    shard_context ctx;

    fixture(const std::string & path, int first, int last)
        : model(params_for(path, first, last)), ctx(model, [] {
              shard_context_params cp;
              cp.n_ctx = 256;
              cp.n_seq_max = 2;
              cp.n_batch = 16;
              return cp;
          }()) {}
};

std::vector<float> forward_tokens(shard_context & ctx, int seq, int pos, const std::vector<int32_t> & toks) {
    shard_input in;
    in.tokens   = toks.data();
    in.n_tokens = (int64_t) toks.size();
    std::vector<float> out((size_t) ctx.output_size(in.n_tokens));
    ctx.forward(seq, pos, in, out.data());
    return out;
}

void check_context_inputs(const std::string & path) {
    const int L = shard_model(params_for(path)).info().n_layer;
    fixture head(path, 0, 1);
    fixture tail(path, 2, L - 1);
    const int n_embd  = head.model.info().n_embd;
    const int n_vocab = head.model.info().n_vocab;

    const std::vector<int32_t> prompt = {3, 9, 27, 81};
    const std::vector<float> before = forward_tokens(head.ctx, 0, 0, prompt);
    const int32_t pos_max = head.ctx.seq_pos_max(0);
    const int64_t cells   = head.ctx.n_cells_used();
    std::vector<float> out(4096 * 8);

    auto unchanged = [&] { return head.ctx.seq_pos_max(0) == pos_max && head.ctx.n_cells_used() == cells; };

    const std::vector<int32_t> oov = {1, n_vocab};
    const std::vector<int32_t> negative = {-1};
    const std::vector<int32_t> one = {5};
    std::vector<int32_t> too_many(17, 1);
    std::vector<float> hidden((size_t) n_embd * 2, 0.5f);

    shard_input in;
    in.tokens = oov.data(); in.n_tokens = 2;
    CHECK_THROWS(head.ctx.forward(0, 4, in, out.data()), SHARD_ERRC_INVALID_ARGUMENT);
    in.tokens = negative.data(); in.n_tokens = 1;
    CHECK_THROWS(head.ctx.forward(0, 4, in, out.data()), SHARD_ERRC_INVALID_ARGUMENT);
    in.tokens = too_many.data(); in.n_tokens = (int64_t) too_many.size();
    CHECK_THROWS(head.ctx.forward(0, 4, in, out.data()), SHARD_ERRC_INVALID_ARGUMENT);
    in.tokens = one.data(); in.n_tokens = 0;
    CHECK_THROWS(head.ctx.forward(0, 4, in, out.data()), SHARD_ERRC_INVALID_ARGUMENT);
    in.n_tokens = 1;
    CHECK_THROWS(head.ctx.forward(0, 6, in, out.data()), SHARD_ERRC_INVALID_ARGUMENT);   // position gap
    CHECK_THROWS(head.ctx.forward(0, 2, in, out.data()), SHARD_ERRC_INVALID_ARGUMENT);   // overlaps the cache
    CHECK_THROWS(head.ctx.forward(2, 0, in, out.data()), SHARD_ERRC_INVALID_ARGUMENT);   // seq id out of range
    CHECK_THROWS(head.ctx.forward(-1, 0, in, out.data()), SHARD_ERRC_INVALID_ARGUMENT);
    shard_input h;
    h.hidden = hidden.data(); h.n_tokens = 2; h.hidden_cols = n_embd;
    CHECK_THROWS(head.ctx.forward(0, 4, h, out.data()), SHARD_ERRC_INVALID_ARGUMENT);    // hidden to the head
    shard_input both = in;
    both.hidden = hidden.data(); both.hidden_cols = n_embd;
    CHECK_THROWS(head.ctx.forward(0, 4, both, out.data()), SHARD_ERRC_INVALID_ARGUMENT);
    CHECK_THROWS(head.ctx.seq_rm(5, 0), SHARD_ERRC_INVALID_ARGUMENT);
    CHECK_THROWS(head.ctx.seq_rm(0, -1), SHARD_ERRC_INVALID_ARGUMENT);
    CHECK(unchanged());

    // the non-head side
    CHECK_THROWS(tail.ctx.forward(0, 0, in, out.data()), SHARD_ERRC_INVALID_ARGUMENT);   // tokens to a non-head
    shard_input bad_cols = h;
    bad_cols.hidden_cols = n_embd - 1;
    CHECK_THROWS(tail.ctx.forward(0, 0, bad_cols, out.data()), SHARD_ERRC_INVALID_ARGUMENT);
    hidden[3] = std::numeric_limits<float>::quiet_NaN();
    CHECK_THROWS(tail.ctx.forward(0, 0, h, out.data()), SHARD_ERRC_INVALID_ARGUMENT);
    hidden[3] = 0.5f;
    CHECK(tail.ctx.seq_pos_max(0) == -1 && tail.ctx.n_cells_used() == 0);

    // capacity: fill the context, the refused call changes nothing
    int pos = 4;
    bool refused = false;
    for (int i = 0; i < 64 && !refused; ++i) {
        std::vector<int32_t> chunk(16, 7);
        try {
            forward_tokens(head.ctx, 0, pos, chunk);
            pos += 16;
        } catch (const shard_error & e) {
            CHECK(e.code == SHARD_ERRC_CAPACITY);
            refused = true;
        }
    }
    CHECK(refused);
    CHECK(head.ctx.seq_pos_max(0) == pos - 1);
    CHECK(head.ctx.n_cells_used() == pos);

    // after all that, the original sequence still computes the same bits as a fresh context
    CHECK(head.ctx.seq_rm(0, 4));
    CHECK(unchanged());
    fixture fresh(path, 0, 1);
    const std::vector<float> again = forward_tokens(head.ctx, 1, 0, prompt);
    const std::vector<float> ref   = forward_tokens(fresh.ctx, 1, 0, prompt);
    CHECK(again.size() == before.size() && std::memcmp(again.data(), before.data(), before.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(again.data(), ref.data(), ref.size() * sizeof(float)) == 0);
}

} // namespace

int main(int argc, char ** argv) {
    if (argc < 4) {
        std::fprintf(stderr, "usage: %s LLAMA.gguf GPT2.gguf SCRATCH_DIR\n", argv[0]);
        return 2;
    }
    check_model_loading(argv[1], argv[2], argv[3]);
    check_context_inputs(argv[1]);
    return finish("test-bad-input");
}
