// A small `--flag value` parser shared by the msa subcommands.
//
//   Args args(argc, argv, /*switches=*/{"help"});  // argv[0] is the subcommand name
//   const int topk = args.get_int("topk", 16, 1, 65536);
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
#include <optional>
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
  // `repeatable`: flags that may be given more than once (--image a.png --image b.png);
  // get_strings returns all their values in order.
  Args(int argc, char** argv, std::set<std::string> switches = {"help"},
       std::set<std::string> repeatable = {});

  bool has(const std::string& flag) const;       // given on the command line
  bool get_switch(const std::string& flag);      // a switch: present or not
  std::string get_string(const std::string& flag);  // required
  std::string get_string(const std::string& flag, const std::string& fallback);
  // Every value of a repeatable flag, in command-line order (empty when absent).
  std::vector<std::string> get_strings(const std::string& flag);
  // Numbers: every numeric flag has a range, and a value outside it (or not a number, or
  // not all of the text) is a UsageError naming the flag, the range and what came. A
  // default is never substituted for a bad value.
  int get_int(const std::string& flag, int fallback, int min, int max);
  int64_t get_int64(const std::string& flag, int64_t fallback, int64_t min, int64_t max);
  uint64_t get_seed(const std::string& flag, uint64_t fallback);  // any value in [0, 2^64)
  // A finite number in [min, max], or (min, max] with min_open.
  double get_double(const std::string& flag, double fallback, double min, double max,
                    bool min_open = false);
  // --threads: 0 (all cores) up to this machine's core count; more threads than cores only
  // make the OpenMP kernels wait for each other.
  int get_threads(const std::string& flag = "threads");
  // Comma-separated integers in [1, max] ("2048,8192"); with allow_none, "none" or "" is empty.
  std::vector<int64_t> get_positive_list(const std::string& flag, const std::string& fallback,
                                         int64_t max, bool allow_none = false);

  // Arguments that are not flags, in order (argv[0] excluded).
  const std::vector<std::string>& positional() const { return positional_; }
  // Throws UsageError naming every given flag that no get_* call asked for.
  void finish() const;

 private:
  const std::string* value_of(const std::string& flag);
  std::map<std::string, std::string> values_;
  std::set<std::string> switches_;
  std::map<std::string, std::vector<std::string>> repeated_;  // repeatable flags' values
  std::set<std::string> used_;
  std::vector<std::string> positional_;
};

// Comma-separated token ids in [0, 2^31) ("5,6,7"); anything else is a UsageError naming --flag.
std::vector<int32_t> parse_token_ids(const std::string& flag, const std::string& text);

// --flag on|off: nothing when the flag is absent (the callee's default stands), else whether
// it is on; any other value is a UsageError naming --flag.
std::optional<bool> parse_on_off(Args& args, const std::string& flag);

// Runs a command's body and returns its exit status; a UsageError prints
// "msa NAME: <what>" and the usage text, any other exception "msa NAME: error: <what>", both
// to stderr, and the status is then 2.
int run_reporting_errors(const char* name, const char* usage, const std::function<int()>& body);

}  // namespace msa::cli
