#pragma once

// page_buffer: bytes in an anonymous mapping of their own, returned to the OS the moment they are
// freed. The warm tier keeps many megabyte-sized KV copies that come and go; from malloc, glibc
// raises its mmap threshold after the first such block is freed, and later blocks then fragment
// the heap, which keeps resident memory past the tier's bound. Capacity is the size rounded up to
// whole pages: that is what the tier charges.

#include <cstddef>
#include <cstdint>
#include <sys/mman.h>
#include <unistd.h>
#include <utility>

namespace llama_shard {

class page_buffer {
public:
    static size_t page_size() {
        static const size_t page = (size_t) sysconf(_SC_PAGESIZE);
        return page;
    }
    static size_t capacity_for(size_t size) { return (size + page_size() - 1) / page_size() * page_size(); }

    page_buffer() = default;

    // a buffer of `size` bytes, or an empty one (size 0) if the mapping failed: callers treat that
    // as "cannot keep this session", never as an exception in the middle of a state change
    static page_buffer allocate(size_t size) {
        page_buffer b;
        if (size == 0) {
            return b;
        }
        void * p = mmap(nullptr, capacity_for(size), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p != MAP_FAILED) {
            b.data_     = static_cast<uint8_t *>(p);
            b.size_     = size;
            b.capacity_ = capacity_for(size);
        }
        return b;
    }
    ~page_buffer() { reset(); }

    page_buffer(const page_buffer &) = delete;
    page_buffer & operator=(const page_buffer &) = delete;
    page_buffer(page_buffer && o) noexcept { *this = std::move(o); }
    page_buffer & operator=(page_buffer && o) noexcept {
        if (this != &o) {
            reset();
            std::swap(data_, o.data_);
            std::swap(size_, o.size_);
            std::swap(capacity_, o.capacity_);
        }
        return *this;
    }

    uint8_t *       data() { return data_; }
    const uint8_t * data() const { return data_; }
    size_t size() const { return size_; }
    size_t capacity() const { return capacity_; }
    bool   empty() const { return size_ == 0; }

    void reset() {
        if (data_ != nullptr) {
            munmap(data_, capacity_);
        }
        data_ = nullptr;
        size_ = capacity_ = 0;
    }

private:
    uint8_t * data_     = nullptr;
    size_t    size_     = 0;
    size_t    capacity_ = 0;
};

} // namespace llama_shard
