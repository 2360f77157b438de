#pragma once

// page_buffer: bytes in an anonymous mapping of their own, returned to the OS the moment they are
// freed. The warm tier keeps many megabyte-sized KV copies that come and go; from malloc, glibc
// raises its mmap threshold after the first such block is freed, and later blocks then fragment
// the heap, which keeps resident memory past the tier's bound. Capacity is the size rounded up to
// whole pages: that is what the tier charges.

#include <cstddef>
#include <cstdint>
#include <new>
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
    explicit page_buffer(size_t size) : size_(size), capacity_(capacity_for(size)) {
        if (capacity_ > 0) {
            void * p = mmap(nullptr, capacity_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (p == MAP_FAILED) {
                throw std::bad_alloc();
            }
            data_ = static_cast<uint8_t *>(p);
        }
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
