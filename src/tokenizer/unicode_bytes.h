// UTF-8 helpers and the byte-level alphabet of GPT-2 style tokenizers: every byte is shown
// as one printable character (printable Latin-1 bytes as themselves, the others as
// U+0100 + n in byte order), so that a token string is text and any byte string has one.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace msa::tok {

// The byte-level character of `byte`, UTF-8 encoded (1 or 2 bytes).
const std::string& byte_to_char(uint8_t byte);
// The byte that code point `cp` stands for, or nothing if it is not a byte-level character.
std::optional<uint8_t> char_to_byte(char32_t cp);
// The byte-level text of raw bytes.
std::string bytes_to_byte_level(std::string_view bytes);

// Appends the UTF-8 encoding of `cp`.
void append_utf8(std::string& out, char32_t cp);
// Length in bytes of the (valid) UTF-8 sequence starting with `lead`.
int utf8_length(uint8_t lead);
// Decodes the code point at `pos` of valid UTF-8 and advances `pos`.
char32_t next_code_point(std::string_view text, size_t& pos);
// True if `text` is valid UTF-8.
bool is_valid_utf8(std::string_view text);
// Replaces each maximal invalid subsequence by U+FFFD (the policy of Rust's
// String::from_utf8_lossy and of the Unicode standard's "substitution of maximal subparts").
std::string utf8_lossy(std::string_view bytes);

}  // namespace msa::tok
