#include "llama_shard/json_schema_grammar.h"

#include "llama_shard/shard_error.h"

#include "json-schema-to-grammar.h"  // the pinned llama.cpp's common/

#include <algorithm>
#include <exception>

namespace llama_shard {

static void bad(const std::string & what) {
    throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "JSON schema: " + what);
}

// the depth of [ and { outside strings, or of ( inside one string (a pattern's groups): checked
// before nlohmann's recursive parser and the converter's recursive visits (of the schema, of a
// pattern's groups) see the text
static int nesting_depth(const std::string & text) {
    int depth = 0, deepest = 0, groups = 0;
    bool in_string = false;
    for (size_t i = 0; i < text.size(); ++i) {
        const char c = text[i];
        if (in_string) {
            if (c == '\\') {
                ++i;
            } else if (c == '"') {
                in_string = false;
            } else if (c == '(') {
                deepest = std::max(deepest, ++groups);
            } else if (c == ')') {
                groups = std::max(0, groups - 1);
            }
        } else if (c == '"') {
            groups = 0;
            in_string = true;
        } else if (c == '[' || c == '{') {
            deepest = std::max(deepest, ++depth);
        } else if (c == ']' || c == '}') {
            --depth;
        }
    }
    return deepest;
}

std::string json_schema_to_gbnf(const std::string & schema_json) {
    if (schema_json.size() > SCHEMA_MAX_BYTES) {
        bad("the schema is " + std::to_string(schema_json.size()) + " bytes; at most " + std::to_string(SCHEMA_MAX_BYTES));
    }
    if (nesting_depth(schema_json) > SCHEMA_MAX_DEPTH) {
        bad("the schema nests deeper than " + std::to_string(SCHEMA_MAX_DEPTH) + " levels");
    }
    try {
        const common_json schema = common_json::parse(schema_json);
        if (!schema.is_object()) {
            bad("a schema is a JSON object");
        }
        return json_schema_to_grammar(schema, /*force_gbnf=*/true);
    } catch (const shard_error &) {
        throw;
    } catch (const std::exception & e) {  // common_json_error, std::invalid_argument, std::runtime_error
        bad(e.what());
    }
    return {};
}

} // namespace llama_shard
