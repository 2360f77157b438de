// ShardContext: one bounded llama_context over a shard (shard_context.h). A file of its own: one
// bound class per file.

#include "bindings.h"

#include <map>
#include <optional>
#include <string>

namespace llama_shard::bindings {

namespace {

using context_class = py::class_<shard_context>;

// forward and forward_batch: Python arrays in, numpy outputs allocated here and written by the engine
void register_context_forward(context_class & cls) {
    cls
        .def("forward", [](shard_context & self, int32_t seq_id, int32_t pos, const py::object & tokens, const py::object & hidden) {
                 const shard_model_info & info = self.model().info();
                 py_input p;
                 parse_input(p, info, tokens, hidden);
                 // a bad n_tokens must not size an allocation; the rest is validated by forward()
                 check_batch_size(p.input, self.n_batch());
                 py::array_t<float> out = output_array(info, p.input.n_tokens);
                 float * dst = out.mutable_data();
                 {
                     py::gil_scoped_release release;  // inputs were copied or pinned above; the output array is owned by this frame
                     self.forward(seq_id, pos, p.input, dst);
                 }
                 return out;
             },
             py::arg("seq_id"), py::arg("pos"), py::arg("tokens") = py::none(), py::arg("hidden") = py::none())
        .def("forward_batch", [](shard_context & self, const py::list & items) {
                 // items: (seq_id, pos, tokens, hidden) tuples of distinct sequences; one output each
                 const shard_model_info & info = self.model().info();
                 std::vector<py_input> inputs(items.size());
                 std::vector<shard_context::batch_item> batch;
                 py::list outs;
                 for (size_t i = 0; i < items.size(); ++i) {
                     py::tuple t = py::cast<py::tuple>(items[i]);
                     if (t.size() != 4) {
                         throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "an item is (seq_id, pos, tokens, hidden)");
                     }
                     parse_input(inputs[i], info, t[2], t[3]);
                     check_batch_size(inputs[i].input, self.n_batch());
                     py::array_t<float> out = output_array(info, inputs[i].input.n_tokens);
                     batch.push_back({py::cast<int32_t>(t[0]), py::cast<int32_t>(t[1]), inputs[i].input, out.mutable_data()});
                     outs.append(out);
                 }
                 {
                     py::gil_scoped_release release;  // the batch holds copies and pinned buffers kept alive by this frame
                     self.forward_batch(batch);
                 }
                 return outs;
             }, py::arg("items"));
}

// what the context holds (its counters, verdicts and cells), each read under its mutex
void register_context_cells(context_class & cls) {
    cls
        .def_property_readonly("n_decode_calls", [](const shard_context & self) {
                 py::gil_scoped_release release;  // waits for the context mutex, held for a whole forward
                 return self.n_decode_calls();
             })
        .def_property_readonly("whole_rows_verdicts", [](const shard_context & self) {
                 std::map<int32_t, std::string> out;
                 {
                     py::gil_scoped_release release;  // waits for the context mutex, held for a whole forward
                     out = self.whole_rows_verdicts();
                 }
                 return out;
             }, "See HotKvEngine.whole_rows_verdicts")
        .def("seq_rm", [](shard_context & self, int32_t seq_id, int32_t p0) {
                 py::gil_scoped_release release;  // waits for the context mutex, held for a whole forward
                 return self.seq_rm(seq_id, p0);
             }, py::arg("seq_id"), py::arg("p0"))
        .def("seq_pos_max", [](const shard_context & self, int32_t seq_id) {
                 py::gil_scoped_release release;  // waits for the context mutex, held for a whole forward
                 return self.seq_pos_max(seq_id);
             }, py::arg("seq_id"));
}

} // namespace

// ShardContext: one bounded llama_context over a shard
void register_context(py::module_ & m) {
    context_class cls(m, "ShardContext");
    cls
        .def(py::init([](const shard_model & model, int32_t n_ctx, int32_t n_seq_max, int32_t n_batch, std::optional<int32_t> n_threads,
                         bool kv_unified, bool swa_full, bool flash_attn) {
                 shard_context_params params;
                 params.kv_unified = kv_unified;
                 params.swa_full   = swa_full;
                 params.flash_attn = flash_attn;
                 params.n_ctx     = n_ctx;
                 params.n_seq_max = n_seq_max;
                 params.n_batch   = n_batch;
                 params.n_threads = n_threads.value_or(0);
                 py::gil_scoped_release release;  // allocating the KV cache; only C++ objects are touched
                 return std::make_unique<shard_context>(model, params);
             }),
             py::arg("model"), py::arg("n_ctx") = 4096, py::arg("n_seq_max") = 4, py::arg("n_batch") = 512,
             py::arg("n_threads") = py::none(), py::arg("kv_unified") = true, py::arg("swa_full") = true,
             py::arg("flash_attn") = true, py::keep_alive<1, 2>())  // the context keeps its model alive
        .def_property_readonly("n_ctx", &shard_context::n_ctx)
        .def_property_readonly("n_seq_max", &shard_context::n_seq_max)
        .def_property_readonly("n_batch", &shard_context::n_batch)
        .def_property_readonly("n_ctx_seq", &shard_context::n_ctx_seq)
        .def_property_readonly("kv_unified", &shard_context::kv_unified)
        .def_property_readonly("n_cells_used", [](const shard_context & self) {
                 py::gil_scoped_release release;  // waits for the context mutex, held for a whole forward
                 return self.n_cells_used();
             });
    register_context_forward(cls);
    register_context_cells(cls);
}

} // namespace llama_shard::bindings
