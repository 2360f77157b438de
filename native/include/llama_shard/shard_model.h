#pragma once

// shard_model: one GGUF model loaded for a contiguous, inclusive range of layers [first, last].
//
// Invariants:
//  - the underlying llama_model is immutable after construction and may be shared by contexts on
//    several threads; the tokenizer calls are read-only;
//  - with a range, only the owned layers' weights are allocated (patch 0002), token_embd only on the
//    head (first == 0), output_norm and the LM head only on the tail (last == n_layer - 1);
//  - without a range the model is the whole model and behaves exactly as upstream llama.cpp;
//  - every input is validated before llama.cpp sees it: a missing, truncated or corrupt file, a range
//    outside [0, n_layer) or reversed, a range on an uncertified architecture, a device ggml does not
//    list, gpu_layers or cpu_moe_layers outside [-1, owned layers] throws shard_error and nothing is loaded;
//  - on the CPU the model is given an empty device list, so no GPU backend takes part even when one
//    is loaded in the process (llama.cpp would otherwise offload large batches' products to it).

#include "llama_shard/devices.h"
#include "llama_shard/shard_error.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

struct llama_model;
struct llama_vocab;
typedef struct ggml_backend_device * ggml_backend_dev_t;

namespace llama_shard {

// architectures whose graphs are patched to honour a shard range and are parity-tested: the one
// list (the bindings expose it as certified_architectures(); Python reads it from there)
const std::vector<std::string> & shard_certified_architectures();
bool shard_arch_is_certified(const std::string & arch);

struct shard_model_info {
    std::string architecture;  // general.architecture of the GGUF, e.g. "llama"
    int32_t     n_layer;       // layers of the whole model
    int32_t     first;         // first owned layer
    int32_t     last;          // last owned layer (inclusive)
    bool        is_head;       // owns layer 0: takes token ids
    bool        is_tail;       // owns the last layer: produces logits
    int32_t     n_embd;
    int32_t     n_vocab;
    int32_t     n_head;
    int32_t     n_head_kv;
    int32_t     head_dim;
    int32_t     n_ctx_train;
    std::string kv_dtype;            // the default KV element type of a context ("f16"; see shard_context_params::kv_type)
    uint64_t    weight_bytes;        // bytes of weight buffers allocated for this shard
    uint64_t    kv_bytes_per_token;  // K and V bytes per cached token over the owned layers, at kv_dtype
    bool        kv_v_rows = true;    // the cache holds V rows (latent attention, deepseek2's MLA, caches K only)
    uint64_t    recurrent_bytes = 0; // a hybrid's recurrent state per session over the owned layers (fixed size)
    int32_t     sliding_window;      // tokens a sliding-window layer attends to (0: no such layers)
    std::string swa_pattern;         // <arch>.attention.sliding_window_pattern as the GGUF writes it ("": the default)
    std::string device;              // where the device layers run: "cpu" or ggml's name ("Vulkan0")
    std::string device_description;  // the driver's name for it ("" on the CPU)
    std::string device_note;         // why `auto` chose the CPU ("" otherwise)
    int32_t     gpu_layers = 0;      // owned layers on the device (the first of the range; 0 on the CPU)
    bool        output_on_device = false;  // a tail's output layer with them (only when all are)
    int32_t     cpu_moe_layers = 0;  // owned layers on the device whose experts stay in host memory

    int32_t n_owned_layers() const { return last - first + 1; }
};

struct shard_model_params {
    std::string path;
    std::optional<std::pair<int32_t, int32_t>> layers;  // inclusive [first, last]; none = whole model
    int32_t n_threads = 0;                               // 0 = number of hardware threads
    // where the owned layers run (devices.h): "cpu" (the default: no GPU backend is touched), "auto"
    // (the first GPU that passes its self-check, else the CPU) or a device name ("Vulkan0")
    std::string device = CPU_DEVICE;
    // owned layers on the device, the first of the range (patch 0008); -1: all of them, and a tail's
    // output layer with them. 0 runs on the CPU. Without a range (the whole model) llama.cpp's own
    // rule applies: the last N layers, the output layer first.
    int32_t gpu_layers = -1;
    // owned layers, the first of the range, whose expert tensors (ffn_*_exps) stay in host memory
    // while the rest of the layer is on the device (llama.cpp's --n-cpu-moe); -1: every owned layer
    // (--cpu-moe); 0: none. Nothing changes on the CPU or for a model without experts.
    int32_t cpu_moe_layers = 0;
    // a dry run: llama.cpp sizes every buffer without allocating or reading the weights (the memory
    // plan, shard_plan_memory); such a model computes nothing
    bool no_alloc = false;
};

class shard_model {
public:
    explicit shard_model(const shard_model_params & params);
    ~shard_model();

    shard_model(const shard_model &) = delete;
    shard_model & operator=(const shard_model &) = delete;

    const shard_model_info & info() const { return info_; }
    int32_t n_threads() const { return n_threads_; }
    const std::string & path() const { return path_; }

    // text -> token ids; by default adds BOS the way llama.cpp does and parses special tokens' text
    // as those tokens (parse_special false: their text is plain text, as transformers'
    // split_special_tokens reads it)
    std::vector<int32_t> tokenize(const std::string & text, bool add_special = true, bool parse_special = true) const;
    // token ids -> text, special tokens rendered as their text; ids outside the vocabulary throw
    std::string detokenize(const std::vector<int32_t> & tokens) const;
    // the GGUF's chat template, empty when it has none
    std::string chat_template() const;
    // formats (role, content) messages with the GGUF's chat template (llama.cpp's built-in
    // templates, no jinja); add_assistant ends with the assistant turn's opening. Throws
    // SHARD_ERRC_INVALID_ARGUMENT when the model has no template llama.cpp recognises.
    std::string apply_chat_template(const std::vector<std::pair<std::string, std::string>> & messages,
                                    bool add_assistant) const;
    int32_t token_eos() const;
    // the BOS token tokenize() puts first, or -1 when the vocabulary adds none
    int32_t token_bos_added() const;
    // every end-of-generation token (EOS, EOT, EOM, and the vocabulary's own end markers)
    std::vector<int32_t> eog_tokens() const;

    llama_model * raw() const { return model_; }
    // the device its device layers run on (nullptr: the CPU)
    ggml_backend_dev_t device() const { return device_; }

private:
    std::string      path_;
    int32_t          n_threads_ = 0;
    llama_model *    model_ = nullptr;
    const llama_vocab * vocab_ = nullptr;
    ggml_backend_dev_t  device_ = nullptr;
    shard_model_info info_{};
};

} // namespace llama_shard
