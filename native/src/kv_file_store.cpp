#include "llama_shard/hot_kv_limits.h"
#include "llama_shard/kv_file_store.h"

#include "llama_shard/shard_error.h"

extern "C" {
#include "hash/sha256/sha256.h"
}
#include "hash/xxhash/xxhash.h"
#ifdef LLAMA_SHARD_SHA256_OPENSSL
#include <openssl/evp.h>
#endif

#include <algorithm>
#include <array>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

namespace llama_shard {

static constexpr char     MAGIC[4]      = {'L', 'S', 'K', 'V'};
static constexpr uint32_t VERSION       = 2;  // 2: the payload's SHA-256 and a keyed MAC replace the checksum
static constexpr size_t   MAX_FIELD     = 128;  // fingerprint and KV type names
static const char *       SUFFIX        = ".kv";
static const char *       TMP_SUFFIX    = ".kv.tmp";
static const char *       KEY_NAME      = "llama-shard.key";
static constexpr size_t   KEY_BYTES     = 32;

static void log_line(const std::string & what) {
    std::fprintf(stderr, "llama-shard warm tier: %s\n", what.c_str());
}

using sha256_digest = std::array<uint8_t, SHA256_DIGEST_SIZE>;
static_assert(sizeof(sha256_digest) == 32, "kv_file_store::digest is a SHA-256");

static uint64_t fnv1a(const std::string & s, uint64_t seed) {
    uint64_t h = seed;
    for (unsigned char c : s) {
        h = (h ^ c) * 0x100000001b3ull;
    }
    return h;
}

// SHA-256 by OpenSSL's libcrypto where the build found it, else by the pinned source's vendored C
// (a 512-token SmolLM2 disk restore: 20 ms against 76-88 ms, benchmarks/warm_files.py); the same digest.
// LLAMA_SHARD_SHA256=vendored forces the vendored one (tests read one build's files with the other).
class sha256_stream {
public:
    sha256_stream() {
#ifdef LLAMA_SHARD_SHA256_OPENSSL
        static const bool forced_vendored = [] {
            const char * v = std::getenv("LLAMA_SHARD_SHA256");
            return v != nullptr && std::strcmp(v, "vendored") == 0;
        }();
        if (!forced_vendored && (evp_ = EVP_MD_CTX_new()) != nullptr && EVP_DigestInit_ex(evp_, EVP_sha256(), nullptr) != 1) {
            EVP_MD_CTX_free(evp_);
            evp_ = nullptr;
        }
#endif
        sha256_init(&vendored_);
    }
    ~sha256_stream() {
#ifdef LLAMA_SHARD_SHA256_OPENSSL
        EVP_MD_CTX_free(evp_);
#endif
    }
    sha256_stream(const sha256_stream &) = delete;
    sha256_stream & operator=(const sha256_stream &) = delete;

    void update(const uint8_t * data, size_t size) {
#ifdef LLAMA_SHARD_SHA256_OPENSSL
        if (evp_ != nullptr) {
            EVP_DigestUpdate(evp_, data, size);
            return;
        }
#endif
        sha256_update(&vendored_, data, size);
    }
    bool uses_openssl() const {
#ifdef LLAMA_SHARD_SHA256_OPENSSL
        return evp_ != nullptr;
#else
        return false;
#endif
    }
    sha256_digest final() {
        sha256_digest out{};
#ifdef LLAMA_SHARD_SHA256_OPENSSL
        if (evp_ != nullptr) {
            unsigned int n = 0;
            EVP_DigestFinal_ex(evp_, out.data(), &n);
            return out;
        }
#endif
        sha256_final(&vendored_, out.data());
        return out;
    }

private:
#ifdef LLAMA_SHARD_SHA256_OPENSSL
    EVP_MD_CTX * evp_ = nullptr;
#endif
    sha256_t vendored_;
};

const char * kv_file_store::sha256_implementation() {
    sha256_stream probe;
    return probe.uses_openssl() ? "openssl" : "vendored";
}

static sha256_digest sha256_of(const uint8_t * data, size_t size) {
    sha256_stream h;
    h.update(data, size);
    return h.final();
}

// HMAC-SHA256 (RFC 2104) of `msg` under the directory's key
static sha256_digest hmac_sha256(const std::array<uint8_t, 32> & key, const uint8_t * msg, size_t size) {
    uint8_t ipad[64], opad[64];
    std::memset(ipad, 0x36, sizeof(ipad));
    std::memset(opad, 0x5c, sizeof(opad));
    for (size_t i = 0; i < key.size(); ++i) {
        ipad[i] ^= key[i];
        opad[i] ^= key[i];
    }
    sha256_stream inner;
    inner.update(ipad, sizeof(ipad));
    inner.update(msg, size);
    const sha256_digest in = inner.final();
    sha256_stream outer;
    outer.update(opad, sizeof(opad));
    outer.update(in.data(), in.size());
    return outer.final();
}

// compares in time that does not depend on where the digests differ
static bool same_digest(const sha256_digest & a, const sha256_digest & b) {
    uint8_t diff = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        diff |= (uint8_t) (a[i] ^ b[i]);
    }
    return diff == 0;
}

// --- header encoding: fixed-width little-endian fields, strings as u32 length + bytes -----------

namespace {

struct writer {
    std::vector<uint8_t> bytes;
    template <typename T> void put(T v) {
        const size_t at = bytes.size();
        bytes.resize(at + sizeof(T));
        std::memcpy(bytes.data() + at, &v, sizeof(T));
    }
    void put_str(const std::string & s) {
        put<uint32_t>((uint32_t) s.size());
        bytes.insert(bytes.end(), s.begin(), s.end());
    }
    void put_digest(const sha256_digest & d) { bytes.insert(bytes.end(), d.begin(), d.end()); }
};

struct reader {
    const uint8_t * p;
    size_t          left;
    bool            ok = true;
    template <typename T> T get() {
        T v{};
        if (left < sizeof(T)) {
            ok = false;
            return v;
        }
        std::memcpy(&v, p, sizeof(T));
        p += sizeof(T);
        left -= sizeof(T);
        return v;
    }
    std::string get_str(size_t max) {
        const uint32_t n = get<uint32_t>();
        if (!ok || n > max || n > left) {
            ok = false;
            return {};
        }
        std::string s((const char *) p, n);
        p += n;
        left -= n;
        return s;
    }
    sha256_digest get_digest() {
        sha256_digest d{};
        if (left < d.size()) {
            ok = false;
            return d;
        }
        std::memcpy(d.data(), p, d.size());
        p += d.size();
        left -= d.size();
        return d;
    }
};

bool write_all(int fd, const uint8_t * data, size_t size) {
    while (size > 0) {
        const ssize_t n = ::write(fd, data, size);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            return false;
        }
        data += n;
        size -= (size_t) n;
    }
    return true;
}

bool read_all(int fd, uint8_t * data, size_t size) {
    while (size > 0) {
        const ssize_t n = ::read(fd, data, size);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            return false;
        }
        data += n;
        size -= (size_t) n;
    }
    return true;
}

bool ends_with(const std::string & s, const char * suffix) {
    const size_t n = std::strlen(suffix);
    return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

} // namespace

// opens a file of the directory for reading: never through a symlink, never blocking (a FIFO), and
// only a regular file; -1 with `why` otherwise
static int open_regular(const std::string & path, std::string & why, struct stat & st) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        why = errno == ELOOP ? "a symbolic link" : std::string("cannot open: ") + std::strerror(errno);
        return -1;
    }
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        ::close(fd);
        why = "not a regular file";
        return -1;
    }
    return fd;
}

kv_file_store::kv_file_store(std::string dir, kv_file_identity identity) : dir_(std::move(dir)), identity_(std::move(identity)) {
    if (dir_.empty()) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "the warm tier's directory is empty");
    }
    if (identity_.recipe_fingerprint.size() > MAX_FIELD || identity_.model_digest.size() > MAX_FIELD ||
        identity_.kv_type.size() > MAX_FIELD) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "a warm tier identity field is longer than 128 bytes");
    }
    if (::mkdir(dir_.c_str(), 0700) != 0 && errno != EEXIST) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "cannot create the warm tier's directory " + dir_ + ": " + std::strerror(errno));
    }
    struct stat st {};
    if (::stat(dir_.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "the warm tier's directory " + dir_ + " is not a directory");
    }
    // whoever can write the directory can plant or swap files the worker loads: only this user may
    if (st.st_uid != ::geteuid()) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "the warm tier's directory " + dir_ + " belongs to another user (uid " +
                                                       std::to_string(st.st_uid) + "); use a directory of this user's");
    }
    if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
        char mode[8];
        std::snprintf(mode, sizeof(mode), "%04o", (unsigned) (st.st_mode & 07777));
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "the warm tier's directory " + dir_ + " is writable by others (mode " +
                                                       mode + "); chmod go-w it (0700 is what the worker creates)");
    }
    load_or_create_key();
}

// the directory's MAC key: 32 random bytes in a file only this user can read, made on first use
void kv_file_store::load_or_create_key() {
    const std::string path = dir_ + "/" + KEY_NAME;
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd >= 0) {
        std::array<uint8_t, KEY_BYTES> fresh{};
        const bool ok = ::getrandom(fresh.data(), fresh.size(), 0) == (ssize_t) fresh.size() &&
                        write_all(fd, fresh.data(), fresh.size()) && ::fsync(fd) == 0;
        ::close(fd);
        if (!ok) {
            ::unlink(path.c_str());
            throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "cannot create the warm tier's key " + path + ": " + std::strerror(errno));
        }
        key_ = fresh;
        log_line("created the directory's key " + path);
        return;
    }
    if (errno != EEXIST) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "cannot create the warm tier's key " + path + ": " + std::strerror(errno));
    }
    std::string why;
    struct stat st {};
    fd = open_regular(path, why, st);
    if (fd < 0) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "the warm tier's key " + path + " is " + why);
    }
    const bool ok = st.st_uid == ::geteuid() && (st.st_mode & 077) == 0 && st.st_size == (off_t) KEY_BYTES &&
                    read_all(fd, key_.data(), key_.size());
    ::close(fd);
    if (!ok) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "the warm tier's key " + path + " must be " + std::to_string(KEY_BYTES) +
                                                       " bytes, this user's, mode 0600 (delete it to start over: the files it signed are then dropped)");
    }
}

std::string kv_file_store::path_for(const std::string & sid) const {
    char name[64];
    std::snprintf(name, sizeof(name), "%016" PRIx64 "%016" PRIx64, fnv1a(sid, 0xcbf29ce484222325ull),
                  fnv1a(sid, 0x84222325cbf29ce4ull));
    return dir_ + "/" + name + SUFFIX;
}

// a regular file that starts with this format's magic: a file the worker (or another of its
// versions) wrote, which it may delete when it is stale or damaged
static bool ours(const std::string & path) {
    std::string why;
    struct stat st {};
    const int fd = open_regular(path, why, st);
    if (fd < 0) {
        return false;
    }
    char magic[4] = {};
    const bool match = ::read(fd, magic, 4) == 4 && std::memcmp(magic, MAGIC, 4) == 0;
    ::close(fd);
    return match;
}

void kv_file_store::discard(const std::string & path, const std::string & why) const {
    log_line("deleted " + path + ": " + why);
    ::unlink(path.c_str());
}

uint64_t kv_file_store::write(const std::string & sid, int64_t epoch, int32_t seq_len, const page_buffer & state) {
    writer w;
    w.bytes.insert(w.bytes.end(), MAGIC, MAGIC + 4);
    w.put<uint32_t>(VERSION);
    w.put_str(identity_.recipe_fingerprint);
    w.put_str(identity_.model_digest);
    w.put<int32_t>(identity_.first);
    w.put<int32_t>(identity_.last);
    w.put<int32_t>(identity_.n_layer);
    w.put_str(identity_.kv_type);
    w.put_str(sid);
    w.put<int64_t>(epoch);
    w.put<int32_t>(seq_len);
    w.put<uint64_t>((uint64_t) state.size());
    w.put_digest(sha256_of(state.data(), state.size()));
    w.put_digest(hmac_sha256(key_, w.bytes.data(), w.bytes.size()));  // over every field above: the payload through its digest

    const std::string path = path_for(sid);
    const std::string tmp  = path.substr(0, path.size() - std::strlen(SUFFIX)) + TMP_SUFFIX;
    // a new file of ours, never an existing one or a symlink planted at the name (O_EXCL | O_NOFOLLOW);
    // a leftover (a crash, or someone else's) is removed first: unlink removes a link, not its target
    int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 && errno == EEXIST && ::unlink(tmp.c_str()) == 0) {
        fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    }
    if (fd < 0) {
        log_line("cannot write " + tmp + ": " + std::strerror(errno) + "; the session is dropped (a cache miss later)");
        return 0;
    }
    const bool ok = write_all(fd, w.bytes.data(), w.bytes.size()) && write_all(fd, state.data(), state.size()) &&
                    ::fsync(fd) == 0;
    const int err = errno;
    ::close(fd);
    if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
        log_line("cannot write " + path + ": " + std::strerror(ok ? errno : err) + "; the session is dropped (a cache miss later)");
        ::unlink(tmp.c_str());
        return 0;
    }
    return (uint64_t) (w.bytes.size() + state.size());
}

bool kv_file_store::read_header(const std::string & path, kv_file_entry & entry, uint64_t & payload_bytes,
                                sha256_digest & payload_sha, size_t & header_bytes, std::string & why) const {
    struct stat st {};
    const int fd = open_regular(path, why, st);
    if (fd < 0) {
        return false;
    }
    std::vector<uint8_t> head(4 + 4 + 4 * (4 + MAX_FIELD) + (4 + HOT_KV_MAX_SESSION_ID_BYTES) + 32 + 2 * SHA256_DIGEST_SIZE);
    const ssize_t n = ::read(fd, head.data(), head.size());
    ::close(fd);
    reader r{head.data(), n > 0 ? (size_t) n : 0};
    if (r.left < 4 || std::memcmp(r.p, MAGIC, 4) != 0) {
        why = "not a llama-shard KV file";
        return false;
    }
    r.p += 4;
    r.left -= 4;
    const uint32_t version = r.get<uint32_t>();
    const std::string fingerprint = r.get_str(MAX_FIELD);
    const std::string model = r.get_str(MAX_FIELD);
    const int32_t first = r.get<int32_t>(), last = r.get<int32_t>(), n_layer = r.get<int32_t>();
    const std::string kv_type = r.get_str(MAX_FIELD);
    entry.session_id = r.get_str(HOT_KV_MAX_SESSION_ID_BYTES);
    entry.epoch      = r.get<int64_t>();
    entry.seq_len    = r.get<int32_t>();
    payload_bytes    = r.get<uint64_t>();
    payload_sha      = r.get_digest();
    const size_t signed_bytes = (size_t) (r.p - head.data());
    const sha256_digest mac = r.get_digest();
    if (version != VERSION) {
        why = "format version " + std::to_string(version) + ", this build reads " + std::to_string(VERSION);
    } else if (!r.ok) {
        why = "truncated header";
    } else if (!same_digest(mac, hmac_sha256(key_, head.data(), signed_bytes))) {
        why = "not signed with this directory's key";  // forged, or copied from another worker's directory
    } else if (fingerprint != identity_.recipe_fingerprint || kv_type != identity_.kv_type) {
        why = "written for another KV recipe";
    } else if (model != identity_.model_digest) {
        why = "written for another model file";
    } else if (first != identity_.first || last != identity_.last || n_layer != identity_.n_layer) {
        why = "written for layers " + std::to_string(first) + "-" + std::to_string(last) + ", this shard owns " +
              std::to_string(identity_.first) + "-" + std::to_string(identity_.last);
    } else if (entry.session_id.empty() || entry.epoch < 0) {
        why = "bad session key";
    } else if (path != path_for(entry.session_id)) {
        why = "file name does not match its session";
    } else {
        header_bytes = (size_t) (r.p - head.data());
        if ((uint64_t) st.st_size != header_bytes + payload_bytes) {
            why = "size " + std::to_string((uint64_t) st.st_size) + " != header + payload " +
                  std::to_string(header_bytes + payload_bytes);
        } else {
            entry.file_bytes = (uint64_t) st.st_size;
            entry.mtime = (double) st.st_mtim.tv_sec + 1e-9 * (double) st.st_mtim.tv_nsec;
            return true;
        }
    }
    return false;
}

bool kv_file_store::read(const std::string & sid, int64_t epoch, int32_t seq_len, uint64_t min_bytes, uint64_t max_bytes,
                         page_buffer & state) {
    const std::string path = path_for(sid);
    kv_file_entry entry;
    uint64_t payload_bytes = 0;
    sha256_digest payload_sha{};
    size_t header_bytes = 0;
    std::string why;
    if (!read_header(path, entry, payload_bytes, payload_sha, header_bytes, why)) {
        if (ours(path)) {
            discard(path, why);
        } else {
            log_line("left alone " + path + ": " + why + " (not a file of this worker's); the session is dropped");
        }
        return false;
    }
    if (entry.session_id != sid || entry.epoch != epoch || entry.seq_len != seq_len) {
        discard(path, "written for another session, epoch or length");
        return false;
    }
    if (payload_bytes < min_bytes || payload_bytes > max_bytes) {
        discard(path, "a payload of " + std::to_string(payload_bytes) + " bytes cannot hold " + std::to_string(seq_len) +
                          " tokens of this shard");
        return false;
    }
    state = page_buffer::allocate((size_t) payload_bytes);
    if (state.empty()) {
        log_line("no memory to read " + path + "; the session is dropped");
        return false;
    }
    struct stat st {};
    const int fd = open_regular(path, why, st);
    const bool ok = fd >= 0 && (uint64_t) st.st_size == header_bytes + payload_bytes && ::lseek(fd, (off_t) header_bytes, SEEK_SET) == (off_t) header_bytes &&
                    read_all(fd, state.data(), state.size());
    if (fd >= 0) {
        ::close(fd);
    }
    if (!ok || !same_digest(sha256_of(state.data(), state.size()), payload_sha)) {
        state.reset();
        discard(path, ok ? "payload digest mismatch" : "read failed");
        return false;
    }
    return true;
}

// XXH3-128 over every byte of the file, read once at start-up: tells a rebuilt or re-quantised
// model from the one a file was written for (an identity, not a defence: the MAC is that)
std::string kv_file_store::model_digest(const std::string & model_path) {
    const int fd = ::open(model_path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return "";
    }
    XXH3_state_t * h = XXH3_createState();
    bool ok = h != nullptr && XXH3_128bits_reset(h) == XXH_OK;
    std::vector<uint8_t> chunk((size_t) 4 << 20);
    uint64_t size = 0;
    while (ok) {
        const ssize_t n = ::read(fd, chunk.data(), chunk.size());
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            ok = n == 0;
            break;
        }
        ok = XXH3_128bits_update(h, chunk.data(), (size_t) n) == XXH_OK;
        size += (uint64_t) n;
    }
    ::close(fd);
    const XXH128_hash_t d = ok ? XXH3_128bits_digest(h) : XXH128_hash_t{};
    XXH3_freeState(h);
    if (!ok) {
        return "";
    }
    char out[64];
    std::snprintf(out, sizeof(out), "%" PRIu64 "-%016" PRIx64 "%016" PRIx64, size, (uint64_t) d.high64, (uint64_t) d.low64);
    return out;
}

void kv_file_store::remove(const std::string & sid) {
    ::unlink(path_for(sid).c_str());
}

std::vector<kv_file_entry> kv_file_store::scan(int32_t max_seq_len) {
    std::vector<kv_file_entry> found;
    DIR * d = ::opendir(dir_.c_str());
    if (d == nullptr) {
        log_line("cannot read " + dir_ + ": " + std::strerror(errno));
        return found;
    }
    std::vector<std::string> names;
    while (const dirent * e = ::readdir(d)) {
        names.emplace_back(e->d_name);
    }
    ::closedir(d);
    for (const std::string & name : names) {
        const std::string path = dir_ + "/" + name;
        if (ends_with(name, TMP_SUFFIX)) {
            discard(path, "an unfinished write");
            continue;
        }
        if (!ends_with(name, SUFFIX)) {
            continue;  // not ours
        }
        kv_file_entry entry;
        uint64_t payload_bytes = 0;
        sha256_digest payload_sha{};
        size_t header_bytes = 0;
        std::string why;
        if (!read_header(path, entry, payload_bytes, payload_sha, header_bytes, why)) {
            if (!ours(path)) {  // an operator's file, a link, a FIFO: not ours to delete
                log_line("left alone " + path + ": " + why + " (not a file of this worker's)");
                continue;
            }
            discard(path, why);
        } else if (entry.seq_len < 1 || entry.seq_len > max_seq_len) {
            discard(path, "length " + std::to_string(entry.seq_len) + " outside [1, " + std::to_string(max_seq_len) + "]");
        } else {
            found.push_back(std::move(entry));
        }
    }
    std::sort(found.begin(), found.end(), [](const kv_file_entry & a, const kv_file_entry & b) { return a.mtime < b.mtime; });
    return found;
}

} // namespace llama_shard
