#include "tokenizer/unicode_bytes.h"

#include <cstdint>
#include <array>

namespace msa::tok {
namespace {

bool is_printable_byte(int b) {
  return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

struct ByteAlphabet {
  std::array<std::string, 256> byte_chars;
  std::array<int, 512> char_bytes;  // code point (< 0x200) -> byte, or -1
  ByteAlphabet() {
    char_bytes.fill(-1);
    int next_extra = 0;
    for (int b = 0; b < 256; ++b) {
      char32_t cp = is_printable_byte(b) ? char32_t(b) : char32_t(0x100 + next_extra++);
      append_utf8(byte_chars[b], cp);
      char_bytes[cp] = b;
    }
  }
};

const ByteAlphabet& alphabet() {
  static const ByteAlphabet instance;
  return instance;
}

// Number of bytes a valid sequence starting with `lead` has; 0 for an invalid lead.
int sequence_length(uint8_t lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;
}

// Whether `b` may follow `lead` as its first continuation byte (excludes overlongs,
// surrogates and code points above U+10FFFF).
bool valid_second(uint8_t lead, uint8_t b) {
  switch (lead) {
    case 0xE0: return b >= 0xA0 && b <= 0xBF;
    case 0xED: return b >= 0x80 && b <= 0x9F;
    case 0xF0: return b >= 0x90 && b <= 0xBF;
    case 0xF4: return b >= 0x80 && b <= 0x8F;
    default: return b >= 0x80 && b <= 0xBF;
  }
}

// Length of the valid sequence at `pos`, or 0 with `bad_len` = bytes of the maximal
// invalid subpart to replace by one U+FFFD.
int valid_sequence_at(std::string_view s, size_t pos, size_t& bad_len) {
  const auto lead = uint8_t(s[pos]);
  const int n = sequence_length(lead);
  if (n == 1) return 1;
  bad_len = 1;
  if (n == 0) return 0;
  for (int i = 1; i < n; ++i) {
    if (pos + i >= s.size()) return 0;
    const auto b = uint8_t(s[pos + i]);
    const bool ok = i == 1 ? valid_second(lead, b) : (b >= 0x80 && b <= 0xBF);
    if (!ok) return 0;
    bad_len = size_t(i) + 1;
  }
  return n;
}

}  // namespace

const std::string& byte_to_char(uint8_t byte) { return alphabet().byte_chars[byte]; }

std::optional<uint8_t> char_to_byte(char32_t cp) {
  if (cp >= 512) return std::nullopt;
  const int b = alphabet().char_bytes[cp];
  if (b < 0) return std::nullopt;
  return uint8_t(b);
}

std::string bytes_to_byte_level(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) out += byte_to_char(uint8_t(c));
  return out;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

int utf8_length(uint8_t lead) {
  const int n = sequence_length(lead);
  return n == 0 ? 1 : n;
}

char32_t next_code_point(std::string_view text, size_t& pos) {
  const auto lead = uint8_t(text[pos]);
  const int n = utf8_length(lead);
  char32_t cp = n == 1 ? lead : n == 2 ? (lead & 0x1F) : n == 3 ? (lead & 0x0F) : (lead & 0x07);
  for (int i = 1; i < n && pos + i < text.size(); ++i) cp = (cp << 6) | (uint8_t(text[pos + i]) & 0x3F);
  pos += size_t(n);
  return cp;
}

bool is_valid_utf8(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    size_t bad = 0;
    const int n = valid_sequence_at(text, pos, bad);
    if (n == 0) return false;
    pos += size_t(n);
  }
  return true;
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t pos = 0;
  while (pos < bytes.size()) {
    size_t bad = 0;
    const int n = valid_sequence_at(bytes, pos, bad);
    if (n > 0) {
      out.append(bytes.substr(pos, size_t(n)));
      pos += size_t(n);
    } else {
      out += "\xEF\xBF\xBD";
      pos += bad;
    }
  }
  return out;
}

}  // namespace msa::tok
