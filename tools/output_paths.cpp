#include "output_paths.h"

#include <filesystem>
#include <system_error>

#include "cli_args.h"

namespace msa::cli {
namespace {

namespace fs = std::filesystem;

// The absolute path with symlinks of its existing part resolved and "." / ".." removed.
fs::path resolved(const std::string& path) {
  std::error_code error;
  const fs::path absolute = fs::absolute(path, error);
  if (error) return fs::path(path).lexically_normal();
  const fs::path canonical = fs::weakly_canonical(absolute, error);
  return error ? absolute.lexically_normal() : canonical;
}

bool same_file(const fs::path& a, const fs::path& b) {
  std::error_code error;
  if (fs::equivalent(a, b, error)) return true;  // hard links, bind mounts, symlinks
  return resolved(a.string()) == resolved(b.string());
}

// Whether `inner` is `outer` or below it (both resolved).
bool is_within(const fs::path& inner, const fs::path& outer) {
  auto i = inner.begin();
  for (auto o = outer.begin(); o != outer.end(); ++o, ++i) {
    if (o->empty()) continue;  // a trailing separator
    if (i == inner.end() || *i != *o) return false;
  }
  return true;
}

[[noreturn]] void refuse(const std::string& flag, const std::string& path, const std::string& why) {
  throw UsageError("--" + flag + ": refusing to write \"" + path + "\": " + why +
                   "; choose another path");
}

}  // namespace

void check_output_path(const std::string& flag, const std::string& path,
                       const std::vector<NamedPath>& inputs) {
  const fs::path out = resolved(path);
  for (const NamedPath& input : inputs) {
    const std::string what = "--" + input.flag + " \"" + input.path + "\"";
    std::error_code error;
    if (fs::is_directory(input.path, error)) {
      const fs::path dir = resolved(input.path);
      if (is_within(out, dir))
        refuse(flag, path, "it lies inside the directory " + what +
                               ", whose files this command reads (it would replace or add to them)");
      for (const auto& entry : fs::directory_iterator(input.path, error))
        if (same_file(entry.path(), path))
          refuse(flag, path, "it is the file " + entry.path().string() + " of " + what);
    } else if (same_file(input.path, path)) {
      refuse(flag, path, "it is the same file as " + what + " (it would be replaced)");
    }
  }
}

void check_new_model_directory(const std::string& flag, const std::string& path, bool force) {
  std::error_code error;
  const fs::file_status status = fs::status(path, error);
  if (!fs::exists(status)) return;
  if (!fs::is_directory(status))
    throw UsageError("--" + flag + ": \"" + path + "\" exists and is not a directory");
  if (fs::directory_iterator(path, error) == fs::directory_iterator() && !error) return;
  if (force) return;
  std::string holds;
  for (const char* name : {"config.json", "model.safetensors", "model.safetensors.index.json",
                           "tokenizer.json", "tokenizer_config.json"})
    if (fs::exists(fs::path(path) / name, error)) holds += (holds.empty() ? "" : ", ") + std::string(name);
  throw UsageError("--" + flag + ": \"" + path + "\" exists and is not empty" +
                   (holds.empty() ? std::string() : " (it holds " + holds + ")") +
                   "; writing a model there replaces its files: pass --force to do that, or "
                   "choose a new directory");
}

}  // namespace msa::cli
