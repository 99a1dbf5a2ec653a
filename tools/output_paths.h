// The guard every command that writes runs on its output paths before anything is read or
// computed: an output never replaces an input (the op's input file, a model's weights or
// config), never lands inside an input model directory, and never replaces an existing
// model unless asked to (--force).
#pragma once
#include <string>
#include <vector>

namespace msa::cli {

// A path the command reads (or has already claimed for another output), and its flag.
struct NamedPath {
  std::string flag;  // without the dashes: "in", "model", "out"
  std::string path;
};

// Throws UsageError when the output --`flag` `path` is the same file as one of `inputs`
// (by name after resolving symlinks and "..", or by identity for hard links), or lies
// inside one that is a directory, or is the same file as any file directly in such a
// directory (a model directory whose files are symlinks elsewhere).
void check_output_path(const std::string& flag, const std::string& path,
                       const std::vector<NamedPath>& inputs);

// Throws UsageError unless the directory --`flag` `path` is new, empty, or `force` is set:
// writing a model into an existing non-empty directory would replace whatever
// config.json, tokenizer.json or weights are there.
void check_new_model_directory(const std::string& flag, const std::string& path, bool force);

}  // namespace msa::cli
