#pragma once

// kv_file_store: the disk tier's files. One file per session in one directory that this worker
// owns; a local cache of KV this process wrote, never a way to accept KV from elsewhere.
//
// A file is a header and a payload (llama.cpp's sequence state of the owned layers):
//   magic "LSKV", format version, the shard's identity (recipe fingerprint, owned range, total
//   layers, KV type), the session key (id, epoch), its length in tokens, the payload's size and
//   a 64-bit checksum of the payload.
// Invariants:
//  - a file is written to a temporary name, flushed with fsync and renamed into place, so a crash
//    leaves either the old file, the new one, or a temporary that the next scan deletes;
//  - nothing is handed back unless every header field matches what the caller expects, the size
//    is exact and the checksum matches; a file that fails any check is deleted, with a log line;
//  - failures (a full disk, an unwritable directory) are return values with a log line, never
//    exceptions: the tier degrades to a cache miss.
// The checksum detects corruption and truncation, not tampering: the directory must be as private
// as the process's memory.

#include "llama_shard/page_buffer.h"

#include <cstdint>
#include <string>
#include <vector>

namespace llama_shard {

// what a file must have been written by to be read back
struct kv_file_identity {
    std::string recipe_fingerprint;  // the KvCacheRecipe fingerprint (architecture, KV type, geometry, range)
    std::string model_digest;        // the model file's size and a checksum of its first and last MiB (weights)
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

    // the digest of a model file kv_file_identity::model_digest holds ("" if it cannot be read)
    static std::string model_digest(const std::string & model_path);

    void remove(const std::string & sid);

    // the valid files of the directory, oldest first; deletes (logged) temporaries and every file
    // that fails a header check or whose length is outside [1, max_seq_len]
    std::vector<kv_file_entry> scan(int32_t max_seq_len);

    // the path a session's file has (two 64-bit hashes of the id: a collision costs a miss, no more)
    std::string path_for(const std::string & sid) const;

    static uint64_t checksum(const uint8_t * data, size_t size);

private:
    bool read_header(const std::string & path, kv_file_entry & entry, uint64_t & payload_bytes, uint64_t & sum,
                     size_t & header_bytes, std::string & why) const;
    void discard(const std::string & path, const std::string & why) const;

    std::string      dir_;
    kv_file_identity identity_;
};

} // namespace llama_shard
