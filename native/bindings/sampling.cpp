// SamplingParams and TokenSampler: llama.cpp's sampler chain for one session (token_sampler.h),
// with the grammar helpers around it. A file of its own: one bound area per file.

#include "bindings.h"

#include "llama_shard/json_schema_grammar.h"
#include "llama_shard/token_sampler.h"

#include "llama.h"

#include <string>
#include <utility>
#include <vector>

namespace llama_shard::bindings {

namespace {

// SamplingParams: the parameters, their defaults the struct's, and the one check of their ranges
void register_sampling_params(py::module_ & m) {
    const sampling_params d;
    py::class_<sampling_params>(m, "SamplingParams",
        "Sampling parameters (sampling_params): defaults leave every sampler but dist off; check() the one check of "
        "their ranges")
        .def(py::init([](float temperature, int32_t top_k, float top_p, float min_p, int32_t penalty_last_n,
                         float penalty_repeat, float penalty_freq, float penalty_present, uint32_t seed,
                         const std::vector<std::pair<int32_t, float>> & logit_bias, const std::string & grammar) {
                 sampling_params p{temperature, top_k, top_p, min_p, penalty_last_n, penalty_repeat, penalty_freq,
                                   penalty_present, seed, {}, grammar};
                 for (const auto & [token, bias] : logit_bias) {
                     p.logit_bias.push_back(token_bias{token, bias});
                 }
                 return p;
             }),
             py::kw_only(), py::arg("temperature") = d.temperature, py::arg("top_k") = d.top_k, py::arg("top_p") = d.top_p,
             py::arg("min_p") = d.min_p, py::arg("penalty_last_n") = d.penalty_last_n,
             py::arg("penalty_repeat") = d.penalty_repeat, py::arg("penalty_freq") = d.penalty_freq,
             py::arg("penalty_present") = d.penalty_present, py::arg("seed") = d.seed,
             py::arg("logit_bias") = std::vector<std::pair<int32_t, float>>{}, py::arg("grammar") = std::string())
        .def_readonly("temperature", &sampling_params::temperature)
        .def_readonly("top_k", &sampling_params::top_k)
        .def_readonly("top_p", &sampling_params::top_p)
        .def_readonly("min_p", &sampling_params::min_p)
        .def_readonly("penalty_last_n", &sampling_params::penalty_last_n)
        .def_readonly("penalty_repeat", &sampling_params::penalty_repeat)
        .def_readonly("penalty_freq", &sampling_params::penalty_freq)
        .def_readonly("penalty_present", &sampling_params::penalty_present)
        .def_readonly("seed", &sampling_params::seed)
        .def_property_readonly("logit_bias", [](const sampling_params & p) {
                 py::list out;
                 for (const token_bias & b : p.logit_bias) {
                     out.append(py::make_tuple(b.token, b.bias));
                 }
                 return out;
             }, "[(token, bias), ...] in the order given")
        .def_readonly("grammar", &sampling_params::grammar)
        .def("check", &sampling_check, py::arg("n_vocab"), py::arg("max_penalty_last_n"),
             "InvalidInputError naming the first parameter outside its range")
        .def("problem", [](const sampling_params & p, int32_t n_vocab, int32_t max_penalty_last_n) -> py::object {
                 const sampling_problem problem = sampling_find_problem(p, n_vocab, max_penalty_last_n);
                 if (problem.field.empty()) {
                     return py::none();
                 }
                 return py::make_tuple(problem.field, problem.message);
             }, py::arg("n_vocab"), py::arg("max_penalty_last_n"),
             "(field, why) of the first parameter outside its range, or None: the one statement of the ranges")
        .def("__repr__", [](const sampling_params & p) {
            return "SamplingParams(temperature=" + std::to_string(p.temperature) + ", top_k=" + std::to_string(p.top_k) +
                   ", top_p=" + std::to_string(p.top_p) + ", min_p=" + std::to_string(p.min_p) + ", penalty_last_n=" +
                   std::to_string(p.penalty_last_n) + ", penalty_repeat=" + std::to_string(p.penalty_repeat) +
                   ", penalty_freq=" + std::to_string(p.penalty_freq) + ", penalty_present=" +
                   std::to_string(p.penalty_present) + ", seed=" + std::to_string(p.seed) + ", logit_bias=[" +
                   std::to_string(p.logit_bias.size()) + " tokens], grammar=" + std::to_string(p.grammar.size()) +
                   " bytes)";
        });
}

// TokenSampler: one session's sampler, rebuilt from what it accepted and drew
void register_token_sampler(py::module_ & m) {
    py::class_<token_sampler>(m, "TokenSampler",
        "One session's sampler: llama.cpp's logit_bias -> penalties -> top_k -> top_p -> min_p -> temperature -> dist(seed). Built "
        "from the tokens it has accepted and the draws it has made, so a replay gives the same tokens")
        .def(py::init([](int32_t n_vocab, const sampling_params & params, int32_t max_penalty_last_n,
                         std::vector<int32_t> history, uint64_t draws, const shard_model * model,
                         std::vector<int32_t> generated) {
                 const llama_vocab * vocab = model != nullptr ? llama_model_get_vocab(model->raw()) : nullptr;
                 py::gil_scoped_release release;  // a grammar's parse and replay may take long; C++ values only
                 return token_sampler::resume(n_vocab, params, max_penalty_last_n, history, draws, vocab, generated);
             }),
             py::arg("n_vocab"), py::arg("params"), py::arg("max_penalty_last_n"), py::kw_only(),
             py::arg("history") = std::vector<int32_t>{}, py::arg("draws") = 0, py::arg("model") = nullptr,
             py::arg("generated") = std::vector<int32_t>{},
             "`model`: the vocabulary a grammar's tokens come from (needed with one); `generated`: every token "
             "sampled so far (draws of them), which the grammar replays")
        .def("sample", [](token_sampler & s, py::array logits) {
                 if (!py::isinstance<py::array_t<float>>(logits) || logits.ndim() != 1 ||
                     !(logits.flags() & py::array::c_style)) {
                     throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "logits must be a contiguous 1-D numpy float32 array");
                 }
                 const float * row = static_cast<const float *>(logits.data());  // the caller holds the array
                 const size_t n = (size_t) logits.shape(0);
                 py::gil_scoped_release release;  // a grammar's mask over the vocabulary may take long
                 return s.sample(row, n);
             },
             py::arg("logits"), "One draw over a row of n_vocab logits (not accepted: call accept with the token kept)")
        .def("accept", &token_sampler::accept, py::arg("token"), "The penalties remember this token (a prompt's)")
        .def("accept_sampled", &token_sampler::accept_sampled, py::arg("token"), py::call_guard<py::gil_scoped_release>(),
             "A sampled token: the grammar advances over it (InvalidInputError, nothing changed, if it does not fit), "
             "then the penalties remember it")
        .def_property_readonly("draws", &token_sampler::draws)
        .def_property_readonly("params", &token_sampler::params);
}

} // namespace

// SamplingParams and TokenSampler: llama.cpp's sampler chain for one session (token_sampler.h)
void register_sampling(py::module_ & m) {
    m.attr("MAX_LOGIT_BIAS") = SAMPLING_MAX_LOGIT_BIAS;
    m.attr("MAX_GRAMMAR_BYTES") = SAMPLING_MAX_GRAMMAR_BYTES;
    m.def("json_schema_to_grammar", [](const std::string & schema_json) {
              py::gil_scoped_release release;  // a large schema takes a while; only C++ objects are touched
              return json_schema_to_gbnf(schema_json);
          }, py::arg("schema_json"),
          "GBNF (start rule `root`) for a JSON Schema given as JSON text, by the pinned llama.cpp's converter; "
          "InvalidInputError for a schema it cannot take");
    m.def("grammar_problem", [](const shard_model & model, const std::string & grammar) -> py::object {
              std::string why;
              {
                  py::gil_scoped_release release;  // llama.cpp's parser: a grammar may take long; strings only
                  why = grammar_problem(llama_model_get_vocab(model.raw()), grammar);
              }
              return why.empty() ? py::object(py::none()) : py::object(py::str(why));
          }, py::arg("model"), py::arg("grammar"),
          "Why llama.cpp's grammar sampler would not take this GBNF over the model's vocabulary, or None");
    register_sampling_params(m);
    register_token_sampler(m);
}

} // namespace llama_shard::bindings
