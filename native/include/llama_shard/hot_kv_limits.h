// The Hot KV engine's bounds on what a caller sends, stated once: the engine checks them, the disk
// tier reads no longer id than they allow, and the bindings export them to Python (MAX_*), whose
// checks and flags use those values rather than their own.
#pragma once

#include <cstddef>
#include <cstdint>

namespace llama_shard {

// a session id is 1 to this many bytes (any bytes: ids are compared, never interpreted)
constexpr size_t HOT_KV_MAX_SESSION_ID_BYTES = 256;
// route epochs are 0 to this (2^62: room for a counter, never near int64's edge)
constexpr int64_t HOT_KV_MAX_EPOCH = int64_t(1) << 62;
// The most tokens one session may hold (context_tokens): a stream of 2^20 cells, 256 streams still
// within llama.cpp's int32 cell count.
constexpr int32_t HOT_KV_MAX_CONTEXT_TOKENS = 1 << 20;
// the most rows of logits one step may return (a speculative verification: the last accepted token
// and up to this many minus one drafts); one step's logits are then at most this many vocab rows
constexpr int32_t HOT_KV_MAX_LOGIT_ROWS = 16;
// the most tokens all sessions together may hold (budget_tokens)
constexpr int64_t HOT_KV_MAX_BUDGET_TOKENS = int64_t(1) << 24;

}  // namespace llama_shard
