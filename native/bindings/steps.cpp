// StepTicket and StepLoop: continuous batching (step_loop.h), and the one conversion of a
// llama_shard.Step into a ticket. A file of its own: one bound area per file, and the loop thread's
// input is built here only.

#include "bindings.h"

#include "llama_shard/hot_kv_engine.h"
#include "llama_shard/step_loop.h"

#include <algorithm>
#include <cmath>
#include <fcntl.h>
#include <limits>
#include <memory>
#include <optional>
#include <string>

namespace llama_shard::bindings {

namespace {

// an optional int attribute of a Step: -1 for None
int32_t optional_position(const py::object & value, const char * name) {
    if (value.is_none()) {
        return -1;
    }
    const int64_t v = py::cast<int64_t>(value);
    if (v < 0 || v > std::numeric_limits<int32_t>::max()) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, std::string(name) + " must be in [0, 2^31), got " + std::to_string(v));
    }
    return (int32_t) v;
}

// a ticket for a llama_shard.Step (kind, session_id, route_epoch, token_ids, hidden, start_pos,
// expected_seq_len, logit_rows, row_by_row): validated, its input copied into the ticket (the loop thread never touches a
// Python object), not queued yet
std::shared_ptr<step_ticket> make_ticket(const step_loop & loop, const shard_model_info & info, const py::object & step,
                                         double now, int notify_fd) {
    auto t = std::make_shared<step_ticket>();
    try {
        t->kind       = py::cast<hot_kv_step_kind>(step.attr("kind"));
        t->session_id = py::cast<std::string>(step.attr("session_id"));
        t->epoch      = py::cast<int64_t>(step.attr("route_epoch"));
        t->position   = t->kind == HOT_KV_STEP_PREFILL ? optional_position(step.attr("start_pos"), "start_pos")
                                                       : optional_position(step.attr("expected_seq_len"), "expected_seq_len");
        py_input p;
        parse_input(p, info, step.attr("token_ids"), step.attr("hidden"));
        if (p.input.n_tokens < 1) {
            throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "a step needs token ids (head) or hidden rows (other shards)");
        }
        t->n_tokens = p.input.n_tokens;
        t->n_logits = py::cast<int32_t>(step.attr("logit_rows"));
        t->row_by_row = py::cast<bool>(step.attr("row_by_row"));
        if (p.input.tokens != nullptr) {
            t->tokens = std::move(p.tokens);
        } else {
            t->hidden.assign(p.input.hidden, p.input.hidden + p.input.n_tokens * info.n_embd);
            // every row is checked now: a chunked prefill must not find a bad row after its first chunk
            if (!std::all_of(t->hidden.begin(), t->hidden.end(), [](float v) { return std::isfinite(v); })) {
                throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "hidden contains a non-finite value");
            }
        }
    } catch (const py::cast_error & e) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, std::string("malformed step: ") + e.what());
    } catch (const py::error_already_set & e) {  // a missing attribute, an int that does not fit
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, std::string("malformed step: ") + e.what());
    }
    if (notify_fd >= 0) {  // the step thread writes to it: it must never block
        const int flags = fcntl(notify_fd, F_GETFL);
        if (flags < 0 || !(flags & O_NONBLOCK)) {
            throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "notify_fd must be an open, non-blocking file descriptor");
        }
    }
    t->now       = now;
    t->notify_fd = notify_fd;
    t->out_cols  = info.is_tail ? 0 : info.n_embd;
    loop.check_ticket(*t);
    return t;
}

// the ticket's output as a numpy array over the ticket's own buffer (no copy; the array keeps the
// ticket alive), or None unless the step completed OK
py::object ticket_output(const std::shared_ptr<step_ticket> & t, const py::object & self) {
    if (!t->done() || t->result().status != SHARD_STATUS_OK) {
        return py::none();
    }
    const auto f = (py::ssize_t) sizeof(float);
    if (t->out_cols == 0) {
        return py::array_t<float>({(py::ssize_t) t->out.size()}, {f}, t->out.data(), self);
    }
    const auto cols = (py::ssize_t) t->out_cols;
    return py::array_t<float>({(py::ssize_t) t->out.size() / cols, cols}, {cols * f, f}, t->out.data(), self);
}

} // namespace

// StepTicket and StepLoop: continuous batching
void register_step_loop(py::module_ & m) {
    py::class_<step_ticket, std::shared_ptr<step_ticket>>(m, "StepTicket",
        "A step queued on a StepLoop: wait() for it (the GIL is released), then read result and output")
        .def_readonly("session_id", &step_ticket::session_id)
        .def("done", &step_ticket::done)
        .def("wait", [](step_ticket & t, std::optional<double> timeout) {
                 py::gil_scoped_release release;  // safe: the ticket is kept alive by the caller's reference
                 if (!timeout) {
                     t.wait();
                     return true;
                 }
                 return t.wait_for(*timeout);
             }, py::arg("timeout") = py::none(), "Blocks until the step completed (or timeout seconds); True when done")
        .def_property_readonly("result", &step_ticket::result)
        .def_property_readonly("output", [](const py::object & self) {
                 return ticket_output(self.cast<std::shared_ptr<step_ticket>>(), self);
             }, "The output (no copy; None unless the step completed OK): hidden rows, or the tail's logits");

    py::class_<step_loop>(m, "StepLoop", "Continuous batching: a native thread forms engine steps from what is pending")
        .def(py::init([](hot_kv_engine & engine, int32_t max_step_tokens, int32_t max_step_sessions, int32_t prefill_chunk,
                         double gather_s) {
                 step_loop_config cfg;
                 cfg.max_step_tokens   = max_step_tokens;
                 cfg.max_step_sessions = max_step_sessions;
                 cfg.prefill_chunk     = prefill_chunk;
                 cfg.gather_s          = gather_s;
                 return std::make_unique<step_loop>(engine, cfg);
             }),
             py::arg("engine"), py::arg("max_step_tokens") = 0, py::arg("max_step_sessions") = 0,
             py::arg("prefill_chunk") = step_loop_config{}.prefill_chunk, py::arg("gather_s") = step_loop_config{}.gather_s,
             py::keep_alive<1, 2>())  // the loop keeps its engine alive
        .def_property_readonly("max_step_tokens", [](const step_loop & l) { return l.config().max_step_tokens; })
        .def_property_readonly("max_step_sessions", [](const step_loop & l) { return l.config().max_step_sessions; })
        .def_property_readonly("prefill_chunk", [](const step_loop & l) { return l.config().prefill_chunk; })
        .def("ticket", [](const step_loop & l, const py::object & step, double now, int notify_fd) {
                 return make_ticket(l, l.engine().model().info(), step, now, notify_fd);
             }, py::arg("step"), py::arg("now"), py::arg("notify_fd") = -1,
             "A ticket for a Step (validated and copied; raises InvalidInputError); not queued yet")
        .def("submit", [](step_loop & l, const std::vector<std::shared_ptr<step_ticket>> & tickets) {
                 l.submit_many(tickets);  // a short lock: no GIL release needed
             }, py::arg("tickets"), "Queues tickets together (a micro-batch shares a step when the caps allow)")
        .def("session_left", &step_loop::session_left, py::arg("session_id"),
             "A released session: the loop stops waiting for its next step")
        .def("close", [](step_loop & l) {
                 py::gil_scoped_release release;  // pending steps finish first; none of them needs the GIL
                 l.close();
             })
        .def("stats", [](const step_loop & l) {
                 const step_loop_stats st = l.stats();
                 return to_dict({{"steps", st.steps},
                                 {"requests", st.requests},
                                 {"chunks", st.chunks},
                                 {"tokens", st.tokens},
                                 {"busy_seconds", st.busy_seconds},
                                 {"pending", st.pending}});
             });
}

} // namespace llama_shard::bindings
