// A small `--flag value` parser shared by the msa subcommands.
//
//   Args args(argc, argv, /*switches=*/{"help"});  // argv[0] is the subcommand name
//   const int topk = args.get_int("topk", 16);
//   const std::string in = args.get_string("in");   // required
//   args.finish();                                   // throws for flags nobody asked for
//
// Accepted forms: `--flag value`, `--flag=value`, and bare `--switch` for names listed as
// switches. A value may start with '-' (negative numbers) but not with "--".
// Every problem throws UsageError; callers print it with their usage text and exit 2.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace msa::cli {

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Args {
 public:
  Args(int argc, char** argv, std::set<std::string> switches = {"help"});

  bool has(const std::string& flag) const;       // given on the command line
  bool get_switch(const std::string& flag);      // a switch: present or not
  std::string get_string(const std::string& flag);  // required
  std::string get_string(const std::string& flag, const std::string& fallback);
  int get_int(const std::string& flag, int fallback);
  double get_double(const std::string& flag, double fallback);
  // Comma-separated positive integers ("2048,8192"); with allow_none, "none" or "" is empty.
  std::vector<int64_t> get_positive_list(const std::string& flag, const std::string& fallback,
                                         bool allow_none = false);

  // Arguments that are not flags, in order (argv[0] excluded).
  const std::vector<std::string>& positional() const { return positional_; }
  // Throws UsageError naming every given flag that no get_* call asked for.
  void finish() const;

 private:
  const std::string* value_of(const std::string& flag);
  std::map<std::string, std::string> values_;
  std::set<std::string> switches_;
  std::set<std::string> used_;
  std::vector<std::string> positional_;
};

// Runs a command's body and returns its exit status; a UsageError prints
// "msa NAME: <what>" and the usage text, any other exception "msa NAME: error: <what>", both
// to stderr, and the status is then 2.
int run_reporting_errors(const char* name, const char* usage, const std::function<int()>& body);

}  // namespace msa::cli
