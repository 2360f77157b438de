// Three string helpers of llama.cpp's common/common.cpp, the only part of common.cpp that the
// JSON Schema converter's files (json-schema-to-grammar.cpp, json-schema.cpp) call. Defined here
// so that those files compile from the pinned source without the rest of llama-common (its chat
// layer, argument parser, downloader and HTTP client: minutes of build for nothing used). Same
// signatures and behaviour as common.cpp's (declared in common.h).
#include "common.h"

#include <sstream>

std::string string_join(const std::vector<std::string> & values, const std::string & separator) {
    std::ostringstream out;
    for (size_t i = 0; i < values.size(); ++i) {
        if (i > 0) {
            out << separator;
        }
        out << values[i];
    }
    return out.str();
}

std::vector<std::string> string_split(const std::string & str, const std::string & delimiter) {
    if (delimiter.empty()) {  // common.cpp's loop would not end; no caller here passes one
        return {str};
    }
    std::vector<std::string> parts;
    size_t start = 0;
    for (size_t end = str.find(delimiter); end != std::string::npos; end = str.find(delimiter, start)) {
        parts.push_back(str.substr(start, end - start));
        start = end + delimiter.length();
    }
    parts.push_back(str.substr(start));
    return parts;
}

std::string string_repeat(const std::string & str, size_t n) {
    std::string out;
    out.reserve(str.size() * n);
    for (size_t i = 0; i < n; ++i) {
        out += str;
    }
    return out;
}
