// safetensors: round trips, the exact byte layout, every malformed header we reject,
// truncated files, unaligned data and sharded model directories.
#include "msa/safetensors.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "test_util.h"

namespace msa {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using msa::testing::bitwise_equal;
using msa::testing::read_bytes;

// A fresh directory per test, removed afterwards.
using SafetensorsTest = msa::testing::TempDirTest;

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string u64_le(uint64_t value) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(value >> (8 * i));
  return out;
}

// A file with `header` (padded to 8 bytes) and `data_bytes` bytes of data.
std::string file_bytes(std::string header, size_t data_bytes) {
  header.append((8 - header.size() % 8) % 8, ' ');
  return u64_le(header.size()) + header + std::string(data_bytes, '\x11');
}

// The names of the entries of `dir`, sorted.
std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

Tensor random_tensor(const Shape& shape, DType dtype) {
  Tensor out = Tensor::zeros(shape, dtype);
  std::normal_distribution<double> normal(0.0, 3.0);
  std::uniform_int_distribution<int> byte(0, 255);
  for (int64_t i = 0; i < out.numel(); ++i) {
    if (dtype_is_float(dtype))
      out.set(i, normal(msa::testing::rng()));
    else if (dtype == DType::u8)
      out.set(i, byte(msa::testing::rng()));
    else
      out.set(i, byte(msa::testing::rng()) * 1000 - 100000);
  }
  return out;
}

constexpr DType kAllDTypes[] = {DType::f32, DType::f64,  DType::bf16, DType::f16,
                                DType::e4m3, DType::i32, DType::i64,  DType::u8};

std::vector<std::pair<std::string, Tensor>> every_dtype_tensors() {
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (DType dtype : kAllDTypes) {
    const std::string name(dtype_name(dtype));
    tensors.emplace_back(name, random_tensor({3, 5}, dtype));
    tensors.emplace_back(name + "_scalar", random_tensor({}, dtype));
    tensors.emplace_back(name + "_empty", Tensor::zeros({0, 4}, dtype));
  }
  return tensors;
}

// Expects open() to throw msa::Error whose message names the file and contains `phrase`.
void expect_open_error(const std::string& path, const std::string& phrase) {
  try {
    SafetensorsFile::open(path);
    ADD_FAILURE() << "no error for " << path << " (expected one about \"" << phrase << "\")";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find(phrase), std::string::npos) << "expected \"" << phrase << "\" in: "
                                                       << message;
  }
}

TEST_F(SafetensorsTest, RoundTripsEveryDtypeScalarAndEmpty) {
  const auto tensors = every_dtype_tensors();
  save_safetensors(path("all.safetensors"), tensors);
  EXPECT_EQ(names_in(dir_), std::vector<std::string>{"all.safetensors"});
  std::vector<Tensor> loaded;
  {
    const SafetensorsFile file = SafetensorsFile::open(path("all.safetensors"));
    const std::vector<std::string> names = file.names();
    EXPECT_EQ(names.size(), tensors.size());
    EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
    for (const auto& [name, tensor] : tensors) {
      ASSERT_TRUE(file.contains(name)) << name;
      loaded.push_back(file.get(name));
    }
  }  // the tensors must outlive the file object
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, tensor] = tensors[i];
    SCOPED_TRACE(name);
    EXPECT_EQ(loaded[i].shape(), tensor.shape());
    EXPECT_EQ(loaded[i].dtype(), tensor.dtype());
    EXPECT_TRUE(bitwise_equal(loaded[i], tensor));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(loaded[i].raw()) % dtype_size(tensor.dtype()), 0u);
  }
}

TEST_F(SafetensorsTest, MetadataRoundTrips) {
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"note", "quotes \" and\nnewlines, ünïcode"}, {"empty", ""}};
  save_safetensors(path("m.safetensors"), {{"x", random_tensor({2}, DType::f32)}}, metadata);
  EXPECT_EQ(SafetensorsFile::open(path("m.safetensors")).metadata(), metadata);
  EXPECT_EQ(SafetensorsModel::open(path("m.safetensors")).metadata(), metadata);
}

// The layout Python's safetensors reads: 8-byte LE length, space-padded JSON header
// (length a multiple of 8), data ranges back to back covering the data section exactly.
TEST_F(SafetensorsTest, WritesThePythonCompatibleLayout) {
  const Tensor a = random_tensor({2, 3}, DType::bf16), b = random_tensor({4}, DType::f64);
  save_safetensors(path("p.safetensors"), {{"a", a}, {"b", b}}, {{"format", "pt"}});
  const std::string bytes = read_bytes(path("p.safetensors"));
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | uint8_t(bytes[i]);
  EXPECT_EQ(header_size % 8, 0u);
  ASSERT_LE(8 + header_size, bytes.size());
  const std::string header_text = bytes.substr(8, header_size);
  EXPECT_EQ(header_text.front(), '{');
  EXPECT_EQ(header_text.find_last_not_of(' '), header_text.rfind('}'));
  const json header = json::parse(header_text);
  EXPECT_EQ(header["__metadata__"], json({{"format", "pt"}}));
  EXPECT_EQ(header["a"]["dtype"], "BF16");
  EXPECT_EQ(header["a"]["shape"], json({2, 3}));
  EXPECT_EQ(header["b"]["dtype"], "F64");
  EXPECT_EQ(header["b"]["shape"], json({4}));
  // Largest element size first: b (8-byte) then a.
  EXPECT_EQ(header["b"]["data_offsets"], json({0, 32}));
  EXPECT_EQ(header["a"]["data_offsets"], json({32, 44}));
  EXPECT_EQ(bytes.size(), 8 + header_size + 44);
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + header_size, b.raw(), 32), 0);
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + header_size + 32, a.raw(), 12), 0);
}

TEST_F(SafetensorsTest, ReadsAHandWrittenFile) {
  const float values[2] = {1.5f, -2.0f};
  std::string bytes = file_bytes(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 0);
  bytes.append(reinterpret_cast<const char*>(values), 8);
  write_bytes(path("h.safetensors"), bytes);
  const Tensor x = SafetensorsFile::open(path("h.safetensors")).get("x");
  EXPECT_EQ(x.get(0), 1.5);
  EXPECT_EQ(x.get(1), -2.0);
}

struct Malformed {
  const char* label;
  std::string bytes;
  const char* phrase;  // part of the expected message
};

std::vector<Malformed> malformed_files() {
  const auto entry = [](const std::string& body) { return "{\"x\":" + body + "}"; };
  const std::string ok_x = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  return {
      {"shorter than 8 bytes", "abc", "at least 8 bytes"},
      {"empty file", "", "at least 8 bytes"},
      {"header longer than the file", u64_le(1000) + "{}", "truncated"},
      {"absurd header length", u64_le(1ull << 40) + std::string(16, ' '), "100 MiB"},
      {"zero header length", u64_le(0), "valid JSON"},
      {"not JSON", file_bytes("{\"x\": [1, 2", 0), "valid JSON"},
      {"invalid UTF-8", file_bytes("{\"\xff\xfe\": 1}", 0), "valid JSON"},
      {"not an object", file_bytes("[1, 2]", 0), "a JSON object"},
      {"deeply nested", file_bytes(std::string(100000, '['), 0), "valid JSON"},
      {"entry not an object", file_bytes(entry("5"), 8), "an object with dtype"},
      {"missing dtype", file_bytes(entry(R"({"shape":[2],"data_offsets":[0,8]})"), 8),
       "\"dtype\""},
      {"missing shape", file_bytes(entry(R"({"dtype":"F32","data_offsets":[0,8]})"), 8),
       "\"shape\""},
      {"missing data_offsets", file_bytes(entry(R"({"dtype":"F32","shape":[2]})"), 8),
       "\"data_offsets\""},
      {"dtype not a string",
       file_bytes(entry(R"({"dtype":4,"shape":[2],"data_offsets":[0,8]})"), 8), "a string"},
      {"unknown dtype",
       file_bytes(entry(R"({"dtype":"F4","shape":[2],"data_offsets":[0,8]})"), 8), "\"F4\""},
      {"shape not an array",
       file_bytes(entry(R"({"dtype":"F32","shape":"2","data_offsets":[0,8]})"), 8),
       "an array of integers"},
      {"fractional extent",
       file_bytes(entry(R"({"dtype":"F32","shape":[2.5],"data_offsets":[0,8]})"), 8),
       "an array of integers"},
      {"negative extent",
       file_bytes(entry(R"({"dtype":"F32","shape":[-2],"data_offsets":[0,8]})"), 8),
       "non-negative extents"},
      {"huge extents",
       file_bytes(entry(R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]})"),
                  8),
       "fits in 64 bits"},
      {"offsets one number", file_bytes(entry(R"({"dtype":"F32","shape":[2],"data_offsets":[0]})"), 8),
       "[begin, end]"},
      {"offsets strings",
       file_bytes(entry(R"({"dtype":"F32","shape":[2],"data_offsets":["0","8"]})"), 8),
       "[begin, end]"},
      {"negative offset",
       file_bytes(entry(R"({"dtype":"F32","shape":[2],"data_offsets":[-8,0]})"), 8),
       "[begin, end]"},
      {"begin after end",
       file_bytes(entry(R"({"dtype":"F32","shape":[0],"data_offsets":[8,0]})"), 8),
       "begin <= end"},
      {"end beyond the data", file_bytes(entry(ok_x), 4), "truncated"},
      {"size mismatch",
       file_bytes(entry(R"({"dtype":"F32","shape":[3],"data_offsets":[0,8]})"), 12),
       "a range of 12 bytes"},
      {"overlap",
       file_bytes(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("y":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                  12),
       "no overlap"},
      {"metadata not an object", file_bytes(R"({"__metadata__":[1]})", 0), "an object of strings"},
      {"metadata value not a string", file_bytes(R"({"__metadata__":{"a":1}})", 0),
       "a string"},
  };
}

TEST_F(SafetensorsTest, RejectsEveryMalformedHeader) {
  for (const Malformed& bad : malformed_files()) {
    SCOPED_TRACE(bad.label);
    write_bytes(path("bad.safetensors"), bad.bytes);
    expect_open_error(path("bad.safetensors"), bad.phrase);
  }
}

TEST_F(SafetensorsTest, EveryTruncationOfAValidFileFailsCleanly) {
  save_safetensors(path("full.safetensors"), every_dtype_tensors(), {{"k", "v"}});
  const std::string bytes = read_bytes(path("full.safetensors"));
  ASSERT_GT(bytes.size(), 100u);
  size_t header_end = 8;
  for (int i = 7; i >= 0; --i) header_end += size_t(uint8_t(bytes[i])) << (8 * i);
  // Every cut through the length and the header, then every 7th byte of the data.
  for (size_t cut = 0; cut < bytes.size(); cut += cut < header_end + 16 ? 1 : 7) {
    write_bytes(path("cut.safetensors"), bytes.substr(0, cut));
    EXPECT_THROW(SafetensorsFile::open(path("cut.safetensors")), Error) << "cut at " << cut;
  }
}

TEST_F(SafetensorsTest, FlippedLengthByteIsDetected) {
  save_safetensors(path("f.safetensors"), {{"x", random_tensor({4}, DType::f32)}});
  std::string bytes = read_bytes(path("f.safetensors"));
  bytes[0] = static_cast<char>(bytes[0] ^ 0x08);  // header length off by 8
  write_bytes(path("f.safetensors"), bytes);
  EXPECT_THROW(SafetensorsFile::open(path("f.safetensors")), Error);
}

TEST_F(SafetensorsTest, UnalignedDataIsCopiedAligned) {
  // u8 [1] at byte 0, then f32 [2] at byte 1: a legal file with a misaligned f32.
  const float values[2] = {3.25f, -7.5f};
  std::string bytes = file_bytes(R"({"b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                                 R"("f":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}})",
                                 0);
  bytes += '\x7f';
  bytes.append(reinterpret_cast<const char*>(values), 8);
  write_bytes(path("u.safetensors"), bytes);
  const SafetensorsFile file = SafetensorsFile::open(path("u.safetensors"));
  const Tensor f = file.get("f");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f.raw()) % 4, 0u);
  EXPECT_EQ(f.get(0), 3.25);
  EXPECT_EQ(f.get(1), -7.5);
  EXPECT_EQ(file.get("b").get(0), 127);
}

TEST_F(SafetensorsTest, UnknownNameNamesTensorAndFile) {
  save_safetensors(path("n.safetensors"), {{"present", random_tensor({1}, DType::f32)}});
  try {
    SafetensorsFile::open(path("n.safetensors")).get("absent");
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("'absent'"), std::string::npos) << message;
    EXPECT_NE(message.find(path("n.safetensors")), std::string::npos) << message;
    EXPECT_NE(message.find("present"), std::string::npos) << message;
  }
}

TEST_F(SafetensorsTest, WritingIntoAViewNeverChangesTheFile) {
  save_safetensors(path("w.safetensors"), {{"x", Tensor::full({4}, DType::f32, 1.0)}});
  const std::string before = read_bytes(path("w.safetensors"));
  Tensor x = SafetensorsFile::open(path("w.safetensors")).get("x");
  x.set(0, 42.0);
  EXPECT_EQ(x.get(0), 42.0);
  EXPECT_EQ(read_bytes(path("w.safetensors")), before);
  EXPECT_EQ(SafetensorsFile::open(path("w.safetensors")).get("x").get(0), 1.0);
}

TEST_F(SafetensorsTest, SaveRejectsBadArgumentsAndLeavesNoFile) {
  const Tensor x = random_tensor({2}, DType::f32);
  EXPECT_THROW(save_safetensors(path("d.safetensors"), {{"x", x}, {"x", x}}), Error);
  EXPECT_THROW(save_safetensors(path("d.safetensors"), {{"__metadata__", x}}), Error);
  EXPECT_THROW(save_safetensors(path("d.safetensors"), {{"", x}}), Error);
  EXPECT_THROW(save_safetensors(path("d.safetensors"), {{"u", Tensor()}}), Error);
  EXPECT_THROW(save_safetensors(path("d.safetensors"), {{"bad\xff", x}}), Error);
  EXPECT_TRUE(names_in(dir_).empty());
  EXPECT_THROW(save_safetensors(path("no/such/dir/d.safetensors"), {{"x", x}}), Error);
}

TEST_F(SafetensorsTest, SaveReplacesAnExistingFileWhole) {
  save_safetensors(path("r.safetensors"), {{"old", random_tensor({100}, DType::f64)}});
  const Tensor x = random_tensor({3}, DType::f32);
  save_safetensors(path("r.safetensors"), {{"x", x}});
  const SafetensorsFile file = SafetensorsFile::open(path("r.safetensors"));
  EXPECT_EQ(file.names(), std::vector<std::string>{"x"});
  EXPECT_TRUE(bitwise_equal(file.get("x"), x));
}

// ---- model directories ----

void write_index(const std::string& path, const json& weight_map) {
  std::ofstream(path) << json({{"metadata", {{"total_size", 123}, {"format", "pt"}}},
                               {"weight_map", weight_map}})
                             .dump(2);
}

TEST_F(SafetensorsTest, ShardedModelReadsTensorsFromEveryShard) {
  const Tensor a = random_tensor({2, 2}, DType::bf16), b = random_tensor({3}, DType::f32),
               c = random_tensor({5}, DType::i32);
  save_safetensors(path("model-00001-of-00002.safetensors"), {{"a", a}, {"b", b}});
  save_safetensors(path("model-00002-of-00002.safetensors"),
                   {{"c", c}, {"unlisted", random_tensor({1}, DType::u8)}});
  write_index(path("model.safetensors.index.json"),
              {{"a", "model-00001-of-00002.safetensors"},
               {"b", "model-00001-of-00002.safetensors"},
               {"c", "model-00002-of-00002.safetensors"}});
  const SafetensorsModel model = SafetensorsModel::open(dir_.string());
  EXPECT_EQ(model.names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_TRUE(bitwise_equal(model.get("a"), a));
  EXPECT_TRUE(bitwise_equal(model.get("b"), b));
  EXPECT_TRUE(bitwise_equal(model.get("c"), c));
  EXPECT_FALSE(model.contains("unlisted"));
  EXPECT_THROW(model.get("unlisted"), Error);
  EXPECT_EQ(model.metadata().at("total_size"), "123");
  EXPECT_EQ(model.metadata().at("format"), "pt");
}

void expect_model_error(const std::string& path, const std::string& phrase) {
  msa::testing::expect_error([&] { SafetensorsModel::open(path); }, phrase);
}

TEST_F(SafetensorsTest, ShardedModelErrors) {
  save_safetensors(path("s1.safetensors"), {{"a", random_tensor({2}, DType::f32)}});
  write_index(path("model.safetensors.index.json"), {{"a", "s1.safetensors"}, {"b", "s2.safetensors"}});
  expect_model_error(dir_.string(), "s2.safetensors");

  write_index(path("model.safetensors.index.json"), {{"a", "s1.safetensors"}, {"z", "s1.safetensors"}});
  expect_model_error(dir_.string(), "weight_map entry 'z'");

  for (const char* escape : {"../s1.safetensors", "sub/s1.safetensors", "..", ""}) {
    write_index(path("model.safetensors.index.json"), {{"a", escape}});
    expect_model_error(dir_.string(), "plain file name");
  }

  write_bytes(path("model.safetensors.index.json"), "{\"weight_map\": [}");
  expect_model_error(dir_.string(), "valid JSON");
  write_bytes(path("model.safetensors.index.json"), "{\"metadata\": {}}");
  expect_model_error(dir_.string(), "\"weight_map\"");
}

TEST_F(SafetensorsTest, ModelDirectoryWithASingleFile) {
  const Tensor a = random_tensor({4}, DType::f16);
  fs::create_directories(dir_ / "single");
  expect_model_error((dir_ / "single").string(), "model.safetensors.index.json");
  save_safetensors((dir_ / "single" / "model.safetensors").string(), {{"a", a}}, {{"k", "v"}});
  const SafetensorsModel model = SafetensorsModel::open((dir_ / "single").string());
  EXPECT_EQ(model.names(), std::vector<std::string>{"a"});
  EXPECT_TRUE(bitwise_equal(model.get("a"), a));
  EXPECT_EQ(model.metadata().at("k"), "v");
}

}  // namespace
}  // namespace msa
