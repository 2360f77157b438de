#pragma once

// kv_file_store: the disk tier's files. One file per session in one directory that this worker
// owns; a local cache of KV this process wrote, never a way to accept KV from elsewhere.
//
// A file is a header and a payload (llama.cpp's sequence state of the owned layers):
//   magic "LSKV", format version, the shard's identity (recipe fingerprint, model digest, owned
//   range, total layers, KV type), the session key (id, which carries the owner's tag, and epoch),
//   its length in tokens, the payload's size and SHA-256, then an HMAC-SHA256 of all of that under
//   the directory's key.
// The key: 32 random bytes in <dir>/llama-shard.key, created 0600 on first use and refused if it is
// not this user's, not private, or not 32 bytes. Whoever lacks it cannot make a file this worker
// loads, for any session or owner, nor move a file between directories (workers).
// Invariants:
//  - a file is written to a temporary name, flushed with fsync and renamed into place, so a crash
//    leaves either the old file, the new one, or a temporary that the next scan deletes;
//  - nothing is handed back unless the MAC is right, every header field matches what the caller
//    expects, the size is exact and the payload's digest matches; a file of this format that fails
//    a check is deleted, with a log line; anything else (another format, a link, a FIFO) is left alone;
//  - failures (a full disk, an unwritable directory) are return values with a log line, never
//    exceptions: the tier degrades to a cache miss.
// The directory must still be this user's and not writable by others (checked at start): the MAC
// stops forgery and transplanting, not deletion or a replay of this directory's own older file of
// the same session, epoch and length.

#include "llama_shard/page_buffer.h"

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace llama_shard {

// what a file must have been written by to be read back
struct kv_file_identity {
    std::string recipe_fingerprint;  // the KvCacheRecipe fingerprint (architecture, KV type, geometry, range)
    std::string model_digest;        // the model file's size and XXH3-128 of all of it (model_digest())
    int32_t     first   = 0;
    int32_t     last    = 0;
    int32_t     n_layer = 0;
    std::string kv_type;
};

// a file's header, as a scan finds it
struct kv_file_entry {
    std::string session_id;
    int64_t     epoch      = 0;
    int32_t     seq_len    = 0;
    uint64_t    file_bytes = 0;
    double      mtime      = 0;  // seconds since the epoch: older files are less recently used
};

class kv_file_store {
public:
    // creates `dir` if it does not exist; throws shard_error(SHARD_ERRC_INVALID_ARGUMENT) if it
    // cannot be created or is not a directory, or an identity field is longer than a header allows
    kv_file_store(std::string dir, kv_file_identity identity);

    const std::string & dir() const { return dir_; }

    // writes the session's state atomically; the file's size, or 0 (logged) if it could not be written
    uint64_t write(const std::string & sid, int64_t epoch, int32_t seq_len, const page_buffer & state);

    // reads the session's state into `state` if the file is whole, was written for exactly this
    // shard, session, epoch and length, and its payload has between min_bytes and max_bytes;
    // otherwise deletes it (logged) and returns false
    bool read(const std::string & sid, int64_t epoch, int32_t seq_len, uint64_t min_bytes, uint64_t max_bytes,
              page_buffer & state);

    // the digest of a model file kv_file_identity::model_digest holds ("" if it cannot be read): it
    // reads the whole file once (about 1 s per 4 GB from the page cache, more from a cold disk)
    static std::string model_digest(const std::string & model_path);

    // "openssl" or "vendored": whose SHA-256 the MAC uses in this process (the same digest either way)
    static const char * sha256_implementation();

    void remove(const std::string & sid);

    // the valid files of the directory, oldest first; deletes (logged) temporaries and every file
    // that fails a header check or whose length is outside [1, max_seq_len]
    std::vector<kv_file_entry> scan(int32_t max_seq_len);

    // the path a session's file has (two 64-bit hashes of the id: a collision costs a miss, no more)
    std::string path_for(const std::string & sid) const;

private:
    using digest = std::array<uint8_t, 32>;  // SHA-256

    void load_or_create_key();
    bool read_header(const std::string & path, kv_file_entry & entry, uint64_t & payload_bytes, digest & payload_sha,
                     size_t & header_bytes, std::string & why) const;
    void discard(const std::string & path, const std::string & why) const;

    std::string      dir_;
    kv_file_identity identity_;
    digest           key_{};
};

} // namespace llama_shard
