#include "llama_shard/shard_model.h"
#include "llama_shard/cpu_backend.h"
#include "llama_shard/devices.h"
#include "llama_shard/kv_type.h"

#include "ggml.h"
#include "gguf.h"
#include "llama.h"

#include <algorithm>
#include <cstdarg>
#include <cstring>
#include <mutex>
#include <sys/stat.h>
#include <thread>

namespace llama_shard {

const char * shard_errc_name(shard_errc code) {
    switch (code) {
        case SHARD_ERRC_INVALID_ARGUMENT:         return "invalid_argument";
        case SHARD_ERRC_MODEL_LOAD:               return "model_load";
        case SHARD_ERRC_UNSUPPORTED_ARCHITECTURE: return "unsupported_architecture";
        case SHARD_ERRC_CAPACITY:                 return "capacity";
        case SHARD_ERRC_COMPUTE:                  return "compute";
    }
    return "unknown";
}

const std::vector<std::string> & shard_certified_architectures() {
    // patch 0011's LLAMA_SHARD_CERTIFIED table in llama.cpp names the same (a test reads it)
    static const std::vector<std::string> certified{"llama", "qwen2", "qwen3", "gemma3",
                                                    "qwen3moe", "gpt-oss", "deepseek2", "glm4moe", "nemotron_h",
                                                    "qwen35", "qwen35moe", "granitehybrid", "llama4", "mistral3",
                                                    "minimax-m2", "phi3", "qwen3next", "nemotron_h_moe", "gemma4"};
    return certified;
}

bool shard_arch_is_certified(const std::string & arch) {
    const auto & c = shard_certified_architectures();
    return std::find(c.begin(), c.end(), arch) != c.end();
}

static std::string certified_list() {
    std::string out;
    for (const std::string & a : shard_certified_architectures()) {
        out += (out.empty() ? "" : ", ") + a;
    }
    return out;
}

//
// GGUF pre-validation: read the header with gguf (no tensor data) before llama.cpp sees the file
//

namespace {

struct gguf_header {
    std::string arch;
    int64_t     n_layer = -1;      // block_count: the trunk's layers and any MTP (nextn) blocks after them
    int64_t     n_layer_nextn = 0;  // nextn_predict_layers: MTP blocks, which no shard's range may reach
    int64_t     key_length = -1;
    int64_t     n_head_kv_max = -1;  // head_count_kv given per layer (hybrids: 0 for a recurrent layer): the largest
    int64_t     n_embd_per_layer = 0;  // gemma4: embedding_length_per_layer_input
    int64_t     n_kv_shared = 0;       // gemma4: attention.shared_kv_layers
};

// the largest value of an integer array of `ctx` (-1: not an integer array)
int64_t gguf_int_array_max(const gguf_context * ctx, int64_t id) {
    if (gguf_get_kv_type(ctx, id) != GGUF_TYPE_ARRAY) {
        return -1;
    }
    const size_t n = gguf_get_arr_n(ctx, id);
    const void * data = gguf_get_arr_data(ctx, id);
    int64_t best = -1;
    for (size_t i = 0; i < n; ++i) {
        int64_t v = -1;
        switch (gguf_get_arr_type(ctx, id)) {
            case GGUF_TYPE_UINT32: v = ((const uint32_t *) data)[i]; break;
            case GGUF_TYPE_INT32:  v = ((const int32_t *) data)[i]; break;
            case GGUF_TYPE_UINT16: v = ((const uint16_t *) data)[i]; break;
            case GGUF_TYPE_INT16:  v = ((const int16_t *) data)[i]; break;
            case GGUF_TYPE_UINT8:  v = ((const uint8_t *) data)[i]; break;
            case GGUF_TYPE_INT8:   v = ((const int8_t *) data)[i]; break;
            default:               return -1;
        }
        best = std::max(best, v);
    }
    return best;
}

int64_t gguf_int_value(const gguf_context * ctx, int64_t id) {
    switch (gguf_get_kv_type(ctx, id)) {
        case GGUF_TYPE_UINT8:  return gguf_get_val_u8(ctx, id);
        case GGUF_TYPE_INT8:   return gguf_get_val_i8(ctx, id);
        case GGUF_TYPE_UINT16: return gguf_get_val_u16(ctx, id);
        case GGUF_TYPE_INT16:  return gguf_get_val_i16(ctx, id);
        case GGUF_TYPE_UINT32: return gguf_get_val_u32(ctx, id);
        case GGUF_TYPE_INT32:  return gguf_get_val_i32(ctx, id);
        case GGUF_TYPE_UINT64: return (int64_t) gguf_get_val_u64(ctx, id);
        case GGUF_TYPE_INT64:  return gguf_get_val_i64(ctx, id);
        default:               return -1;
    }
}

gguf_header read_gguf_header(const std::string & path) {
    struct stat st {};
    if (stat(path.c_str(), &st) != 0) {
        throw shard_error(SHARD_ERRC_MODEL_LOAD, "model file not found: " + path);
    }
    if (!S_ISREG(st.st_mode)) {
        throw shard_error(SHARD_ERRC_MODEL_LOAD, "model path is not a regular file: " + path);
    }
    gguf_init_params params = { /*no_alloc =*/ true, /*ctx =*/ nullptr };
    gguf_context * ctx = gguf_init_from_file(path.c_str(), params);
    if (ctx == nullptr) {
        throw shard_error(SHARD_ERRC_MODEL_LOAD, "not a readable GGUF file (truncated or corrupt header): " + path);
    }
    gguf_header h;
    const int64_t arch_id = gguf_find_key(ctx, "general.architecture");
    if (arch_id >= 0 && gguf_get_kv_type(ctx, arch_id) == GGUF_TYPE_STRING) {
        h.arch = gguf_get_val_str(ctx, arch_id);
    }
    if (!h.arch.empty()) {
        // `<arch>.<key>` read by `read` into `out` where the file has it (a missing key keeps the default)
        auto key = [&](const char * name, int64_t & out, int64_t (*read)(const gguf_context *, int64_t)) {
            const int64_t id = gguf_find_key(ctx, (h.arch + "." + name).c_str());
            if (id >= 0) {
                out = read(ctx, id);
            }
        };
        key("block_count", h.n_layer, gguf_int_value);
        key("nextn_predict_layers", h.n_layer_nextn, gguf_int_value);
        key("attention.head_count_kv", h.n_head_kv_max, gguf_int_array_max);
        key("attention.key_length", h.key_length, gguf_int_value);
        key("embedding_length_per_layer_input", h.n_embd_per_layer, gguf_int_value);
        key("attention.shared_kv_layers", h.n_kv_shared, gguf_int_value);
    }
    // llama.cpp's CPU ssm_conv asserts an f32 kernel at the first decode (an abort): refused here
    for (int64_t t = 0; t < gguf_get_n_tensors(ctx); ++t) {
        const std::string name = gguf_get_tensor_name(ctx, t);
        const ggml_type type = gguf_get_tensor_type(ctx, t);
        if (name.size() > 18 && name.compare(name.size() - 18, 18, ".ssm_conv1d.weight") == 0 && type != GGML_TYPE_F32) {
            gguf_free(ctx);
            throw shard_error(SHARD_ERRC_MODEL_LOAD, "tensor " + name + " is " + ggml_type_name(type) +
                              "; a recurrent layer's conv kernel must be f32: " + path);
        }
    }
    gguf_free(ctx);
    if (h.arch.empty()) {
        throw shard_error(SHARD_ERRC_MODEL_LOAD, "GGUF file has no general.architecture: " + path);
    }
    return h;
}

// why a file of a certified or known family cannot be split exactly ("" when it can): its layers pass
// more than one residual row per token to the next layer, and a shard boundary passes one (each read
// in the pin's graph builder)
std::string unsplittable_reason(const gguf_header & h) {
    static const std::pair<const char *, const char *> families[] = {
        {"deepseek4", "it carries several hyper-connection residual streams between layers "
                      "(hyper_connection.count), and its first layers route experts by token id"},
        {"glm5-next", "it carries 4 mHC residual streams between layers, and its shared-indexer layers reuse an "
                      "earlier layer's sparse-attention selection"},
        {"kimi-k3",   "its cross-layer residual attention mixes the saved inputs of every attn_res.block_size-th "
                      "layer into every later layer and the output"},
    };
    for (const auto & [name, why] : families) {
        if (h.arch == name) {
            return why;
        }
    }
    // gemma4 is certified for files without per-layer inputs and without KV shared between layers
    // (patch 0014 refuses the others in llama.cpp too)
    if (h.arch == "gemma4" && h.n_embd_per_layer > 0) {
        return "this file feeds every layer a per-layer input (embedding_length_per_layer_input " +
               std::to_string(h.n_embd_per_layer) + ") computed before the layer loop from the token ids and embedding";
    }
    if (h.arch == "gemma4" && h.n_kv_shared > 0) {
        return "the last " + std::to_string(h.n_kv_shared) + " layers of this file reuse earlier layers' KV cache "
               "(attention.shared_kv_layers)";
    }
    return "";
}

//
// the constructor's steps, in order: the request checked against the file's header, the device
// chosen, the weights loaded, the info read back (nothing is loaded until every check passed)
//

// n_threads as given, 0: every hardware thread
int32_t thread_count(int32_t n_threads) {
    if (n_threads < 0) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "n_threads must be >= 0 (0 = all hardware threads)");
    }
    return n_threads > 0 ? n_threads : (int32_t) std::max(1u, std::thread::hardware_concurrency());
}

// a layer range [first, last]: an architecture that can be split exactly and is certified, a range
// inside the trunk (the MTP blocks after it are no shard's)
void check_layer_range(const gguf_header & header, int32_t first, int32_t last) {
    if (const std::string why = unsplittable_reason(header); !why.empty()) {
        throw shard_error(SHARD_ERRC_UNSUPPORTED_ARCHITECTURE,
            "architecture '" + header.arch + "' cannot be split exactly: " + why +
            "; a shard boundary passes one residual row per token (run it whole, without a layer range)");
    }
    if (!shard_arch_is_certified(header.arch)) {
        throw shard_error(SHARD_ERRC_UNSUPPORTED_ARCHITECTURE,
            "architecture '" + header.arch + "' is not certified for shard execution (supported: " + certified_list() + ")");
    }
    if (header.n_layer <= 0) {
        throw shard_error(SHARD_ERRC_MODEL_LOAD, "GGUF file has no " + header.arch + ".block_count");
    }
    const int64_t n_trunk = header.n_layer - std::max<int64_t>(0, header.n_layer_nextn);
    if (n_trunk <= 0) {
        throw shard_error(SHARD_ERRC_MODEL_LOAD, "GGUF file has " + std::to_string(header.n_layer_nextn) +
                          " MTP layers of " + std::to_string(header.n_layer) + " blocks: no trunk to split");
    }
    if (first < 0 || last < first || last >= n_trunk) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT,
            "layer range [" + std::to_string(first) + ", " + std::to_string(last) + "] is not inside [0, " +
            std::to_string(n_trunk - 1) + "] with first <= last" +
            (header.n_layer_nextn > 0 ? " (layers " + std::to_string(n_trunk) + "-" + std::to_string(header.n_layer - 1) +
                                        " are MTP blocks, which no shard owns)" : std::string()));
    }
}

// the layers this shard owns: its range, or the whole trunk
int32_t owned_layers(const shard_model_params & params, const gguf_header & header) {
    return params.layers ? params.layers->second - params.layers->first + 1
                         : (int32_t) (header.n_layer - std::max<int64_t>(0, header.n_layer_nextn));
}

// gpu_layers and cpu_moe_layers within the owned layers, and layers on a device only with a device named
void check_placement(const shard_model_params & params, int32_t n_owned) {
    if (params.gpu_layers < -1 || (n_owned > 0 && params.gpu_layers > n_owned)) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT,
            "gpu_layers " + std::to_string(params.gpu_layers) + " is outside [0, " + std::to_string(n_owned) +
            "] (the owned layers; -1: all of them)");
    }

    if (params.cpu_moe_layers < -1 || (n_owned > 0 && params.cpu_moe_layers > n_owned)) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT,
            "cpu_moe_layers " + std::to_string(params.cpu_moe_layers) + " is outside [0, " + std::to_string(n_owned) +
            "] (the owned layers whose experts stay in host memory; -1: all of them)");
    }

    if (params.gpu_layers > 0 && is_cpu_device(params.device)) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "gpu_layers " + std::to_string(params.gpu_layers) +
                          " puts layers on a device, and the device is the CPU: name one (or auto)");
    }
}

// llama.cpp's load of the file onto `device` (nullptr: the CPU only), n_cpu_moe owned layers' experts in host memory
llama_model * load_llama_model(const shard_model_params & params, ggml_backend_dev_t device, int32_t n_cpu_moe) {
    ggml_backend_dev_t device_list[2] = {device, nullptr};  // {nullptr, ...}: an empty list, the CPU only

    llama_model_params mparams = llama_model_default_params();
    mparams.devices      = device_list;
    mparams.n_gpu_layers = device == nullptr ? 0 : params.gpu_layers;  // -1: llama.cpp's "all"
    mparams.no_alloc     = params.no_alloc;
    // --cpu-moe: the expert tensors of the chosen owned layers in host memory (llama.cpp's own
    // override, common.h's LLM_FFN_EXPS_REGEX); the patterns outlive the load, which reads them
    std::vector<std::string> moe_patterns;
    std::vector<llama_model_tensor_buft_override> overrides;
    if (n_cpu_moe > 0) {
        const int32_t first_owned = params.layers ? params.layers->first : 0;
        for (int32_t il = first_owned; il < first_owned + n_cpu_moe; ++il) {
            moe_patterns.push_back("blk\\." + std::to_string(il) + "\\.ffn_(up|down|gate|gate_up)_(ch|)exps");
        }
        ggml_backend_buffer_type_t host = ggml_backend_dev_buffer_type(ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU));
        for (const std::string & pattern : moe_patterns) {
            overrides.push_back({pattern.c_str(), host});
        }
        overrides.push_back({nullptr, nullptr});
        mparams.tensor_buft_overrides = overrides.data();
    }
    if (params.no_alloc) {
        mparams.load_mode = LLAMA_LOAD_MODE_NONE;  // llama.cpp asserts that a dry run maps nothing (as common/fit does)
    }
    if (params.layers) {
        mparams.shard_layer_first = params.layers->first;
        mparams.shard_layer_last  = params.layers->second;
    }
    shard_clear_llama_error();
    llama_model * model = llama_model_load_from_file(params.path.c_str(), mparams);
    if (model == nullptr) {
        const std::string why = shard_last_llama_error();
        throw shard_error(SHARD_ERRC_MODEL_LOAD,
            "llama.cpp could not load " + params.path + (why.empty() ? std::string() : ": " + why));
    }
    return model;
}

// what the loaded model is: its architecture, range, shape and the bytes its weights and KV take
void read_model_info(shard_model_info & info, const llama_model * model, const llama_vocab * vocab,
                     const gguf_header & header, const shard_model_params & params) {
    info.architecture = header.arch;
    info.n_layer      = llama_model_n_layer(model);
    info.first        = params.layers ? params.layers->first  : 0;
    info.last         = params.layers ? params.layers->second : info.n_layer - 1;
    info.is_head      = info.first == 0;
    info.is_tail      = info.last == info.n_layer - 1;
    info.n_embd       = llama_model_n_embd(model);
    info.n_vocab      = llama_vocab_n_tokens(vocab);
    info.n_head       = llama_model_n_head(model);
    // layer 0's, or the largest of a per-layer array (a hybrid's recurrent layers have none)
    info.n_head_kv    = header.n_head_kv_max > 0 ? (int32_t) header.n_head_kv_max : llama_model_n_head_kv(model);
    info.head_dim     = header.key_length > 0 ? (int32_t) header.key_length : info.n_embd / std::max(1, info.n_head);
    info.n_ctx_train  = llama_model_n_ctx_train(model);
    info.kv_dtype     = "f16";
    info.weight_bytes = llama_model_weight_bytes(model);
    info.kv_bytes_per_token = llama_model_kv_bytes_per_token(model, GGML_TYPE_F16, GGML_TYPE_F16);  // at the default KV type
    // a cache with V rows costs more when they are wider: one without (latent attention) does not
    info.recurrent_bytes = llama_model_recurrent_state_bytes(model);
    info.kv_v_rows = llama_model_kv_bytes_per_token(model, GGML_TYPE_F16, GGML_TYPE_F32) != info.kv_bytes_per_token ||
                     info.n_owned_layers() == 0;
    info.sliding_window     = llama_model_n_swa(model);
}

// where the loaded model's layers run: the device (or why the CPU), the layers on it, their experts' home
void read_placement(shard_model_info & info, const shard_model_params & params, ggml_backend_dev_t device,
                    const std::string & why_cpu, int32_t n_owned, int32_t n_cpu_moe) {
    info.device             = device != nullptr ? ggml_backend_dev_name(device) : CPU_DEVICE;
    info.device_description = device != nullptr ? ggml_backend_dev_description(device) : "";
    info.device_note        = why_cpu;
    if (device == nullptr) {
        info.gpu_layers = 0;
    } else if (params.layers) {  // patch 0008: the first N owned layers, the output layer only with all of them
        info.gpu_layers       = params.gpu_layers < 0 ? n_owned : params.gpu_layers;
        info.output_on_device = info.is_tail && info.gpu_layers == n_owned;
    } else {  // the whole model, upstream's rule: the output layer first, then the last N - 1 layers
        info.gpu_layers       = params.gpu_layers < 0 ? n_owned : std::max(0, std::min(params.gpu_layers, n_owned + 1) - 1);
        info.output_on_device = true;
    }
    info.cpu_moe_layers = std::min(n_cpu_moe, info.gpu_layers);  // of the layers on the device (the others are on the host whole)
}

// <arch>.attention.sliding_window_pattern as the GGUF writes it ("" when it has none)
std::string read_swa_pattern(const llama_model * model, const std::string & architecture) {
    char buf[512] = {0};
    const std::string key = architecture + ".attention.sliding_window_pattern";
    if (llama_model_meta_val_str(model, key.c_str(), buf, sizeof(buf)) >= 0) {
        return buf;
    }
    return std::string();
}

} // namespace

//
// shard_model
//

shard_model::shard_model(const shard_model_params & params) : path_(params.path) {
    n_threads_ = thread_count(params.n_threads);

    const gguf_header header = read_gguf_header(params.path);
    if (params.layers) {
        check_layer_range(header, params.layers->first, params.layers->second);
    }
    const int32_t n_owned = owned_layers(params, header);
    check_placement(params, n_owned);

    shard_backend_init();
    shard_load_cpu_backend();  // a portable build picks its CPU variant here, before the first model

    std::string why_cpu;
    ggml_backend_dev_t device = shard_choose_device(params.device, &why_cpu);  // a bad name throws, whatever gpu_layers says
    if (params.gpu_layers == 0) {
        device = nullptr;
        why_cpu.clear();
    }
    const int32_t n_cpu_moe = device == nullptr ? 0 : (params.cpu_moe_layers < 0 ? n_owned : params.cpu_moe_layers);
    model_ = load_llama_model(params, device, n_cpu_moe);
    vocab_ = llama_model_get_vocab(model_);
    device_ = device;

    read_model_info(info_, model_, vocab_, header, params);
    read_placement(info_, params, device, why_cpu, n_owned, n_cpu_moe);
    info_.swa_pattern = read_swa_pattern(model_, info_.architecture);
}

shard_model::~shard_model() {
    if (model_ != nullptr) {
        llama_model_free(model_);
    }
}

std::vector<int32_t> shard_model::tokenize(const std::string & text, bool add_special, bool parse_special) const {
    if (text.size() > (size_t) INT32_MAX / 2) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "text is too long to tokenize");
    }
    if (llama_vocab_type(vocab_) == LLAMA_VOCAB_TYPE_NONE) {
        // llama.cpp aborts when asked to tokenize with no vocabulary
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "this model has no tokenizer (tokenizer.ggml.model is 'none')");
    }
    std::vector<llama_token> out(text.size() + 8);
    int32_t n = llama_tokenize(vocab_, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(),
                               add_special, parse_special);
    if (n < 0) {
        out.resize((size_t) -n);
        n = llama_tokenize(vocab_, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), add_special,
                           parse_special);
    }
    if (n < 0) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "tokenization failed");
    }
    out.resize((size_t) n);
    return out;
}

std::string shard_model::detokenize(const std::vector<int32_t> & tokens) const {
    for (int32_t t : tokens) {
        if (t < 0 || t >= info_.n_vocab) {
            throw shard_error(SHARD_ERRC_INVALID_ARGUMENT,
                "token id " + std::to_string(t) + " is outside the vocabulary [0, " + std::to_string(info_.n_vocab) + ")");
        }
    }
    std::string text(tokens.size() * 8 + 16, '\0');
    int32_t n = llama_detokenize(vocab_, tokens.data(), (int32_t) tokens.size(), text.data(), (int32_t) text.size(),
                                 /*remove_special*/ false, /*unparse_special*/ true);
    if (n < 0) {
        text.resize((size_t) -n);
        n = llama_detokenize(vocab_, tokens.data(), (int32_t) tokens.size(), text.data(), (int32_t) text.size(), false, true);
    }
    if (n < 0) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "detokenization failed");
    }
    text.resize((size_t) n);
    return text;
}

std::string shard_model::chat_template() const {
    const char * tmpl = llama_model_chat_template(model_, nullptr);
    return tmpl ? std::string(tmpl) : std::string();
}

std::string shard_model::apply_chat_template(const std::vector<std::pair<std::string, std::string>> & messages,
                                             bool add_assistant) const {
    const char * tmpl = llama_model_chat_template(model_, nullptr);
    if (tmpl == nullptr) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "this model has no chat template");
    }
    std::vector<llama_chat_message> chat;
    size_t total = 0;
    for (const auto & [role, content] : messages) {
        chat.push_back({role.c_str(), content.c_str()});
        total += role.size() + content.size();
    }
    std::string out(2 * total + 256, '\0');
    int32_t n = llama_chat_apply_template(tmpl, chat.data(), chat.size(), add_assistant, out.data(), (int32_t) out.size());
    if (n > (int32_t) out.size()) {
        out.resize((size_t) n);
        n = llama_chat_apply_template(tmpl, chat.data(), chat.size(), add_assistant, out.data(), (int32_t) out.size());
    }
    if (n < 0) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "llama.cpp does not support this model's chat template");
    }
    out.resize((size_t) n);
    return out;
}

int32_t shard_model::token_eos() const {
    return llama_vocab_eos(vocab_);
}

int32_t shard_model::token_bos_added() const {
    if (llama_vocab_type(vocab_) == LLAMA_VOCAB_TYPE_NONE || !llama_vocab_get_add_bos(vocab_)) {
        return -1;
    }
    return llama_vocab_bos(vocab_);
}

std::vector<int32_t> shard_model::eog_tokens() const {
    std::vector<int32_t> out;
    if (llama_vocab_type(vocab_) == LLAMA_VOCAB_TYPE_NONE) {
        return out;
    }
    for (int32_t t = 0; t < info_.n_vocab; ++t) {
        if (llama_vocab_is_eog(vocab_, t)) {
            out.push_back(t);
        }
    }
    return out;
}

} // namespace llama_shard
