#pragma once

// Minimal check helpers for the CTest conformance programs: each failed CHECK prints where and
// what, and the program exits non-zero at the end.

#include <cstdio>
#include <cstdlib>

static int g_failures = 0;

#define CHECK(cond)                                                                   \
    do {                                                                              \
        if (!(cond)) {                                                                \
            std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            ++g_failures;                                                             \
        }                                                                             \
    } while (0)

// CHECK_THROWS(code, errc): the statement must throw shard_error with that code
#define CHECK_THROWS(stmt, errc)                                                      \
    do {                                                                              \
        bool thrown_ = false;                                                         \
        try {                                                                         \
            stmt;                                                                     \
        } catch (const llama_shard::shard_error & e) {                                \
            thrown_ = true;                                                           \
            if (e.code != (errc)) {                                                   \
                std::fprintf(stderr, "%s:%d: %s threw %s (%s), expected %s\n", __FILE__, __LINE__, #stmt, \
                             llama_shard::shard_errc_name(e.code), e.what(), llama_shard::shard_errc_name(errc)); \
                ++g_failures;                                                         \
            }                                                                         \
        }                                                                             \
        if (!thrown_) {                                                               \
            std::fprintf(stderr, "%s:%d: %s did not throw\n", __FILE__, __LINE__, #stmt); \
            ++g_failures;                                                             \
        }                                                                             \
    } while (0)

static int finish(const char * name) {
    if (g_failures == 0) {
        std::printf("%s: all checks passed\n", name);
        return 0;
    }
    std::fprintf(stderr, "%s: %d check(s) failed\n", name, g_failures);
    return 1;
}
