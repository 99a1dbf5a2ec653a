// The C++ side of tests/parity/tokenizer_parity.py: reads a request JSON file, runs msa's
// tokenizer and chat template on it, writes the results as JSON.
//
// request:  {"tokenizer": path,
//            "encode": [{"text": str, "add_special_tokens": bool}, ...],
//            "decode": [{"ids": [int], "skip_special_tokens": bool}, ...],
//            "render": [{"template": str, "context": {...}}, ...]}
// response: {"encode": [[int]], "decode": [str], "render": [str or {"error": str}],
//            "vocab_size": int}
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "msa/error.h"
#include "msa/tokenizer.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: " << argv[0] << " REQUEST.json RESPONSE.json\n";
    return 2;
  }
  try {
    std::ifstream in(argv[1]);
    const auto request = nlohmann::ordered_json::parse(in);
    nlohmann::ordered_json response;
    if (request.contains("tokenizer")) {
      const auto tokenizer = msa::Tokenizer::from_file(request["tokenizer"].get<std::string>());
      response["vocab_size"] = tokenizer.vocab_size();
      response["encode"] = nlohmann::ordered_json::array();
      for (const auto& item : request.value("encode", nlohmann::ordered_json::array()))
        response["encode"].push_back(tokenizer.encode(item["text"].get<std::string>(),
                                                      item.value("add_special_tokens", false)));
      response["decode"] = nlohmann::ordered_json::array();
      for (const auto& item : request.value("decode", nlohmann::ordered_json::array())) {
        const auto ids = item["ids"].get<std::vector<int32_t>>();
        response["decode"].push_back(tokenizer.decode(ids, item.value("skip_special_tokens", false)));
      }
    }
    response["render"] = nlohmann::ordered_json::array();
    for (const auto& item : request.value("render", nlohmann::ordered_json::array())) {
      try {
        const auto chat_template = msa::ChatTemplate::from_string(item["template"].get<std::string>());
        response["render"].push_back(chat_template.render_json(item["context"].dump()));
      } catch (const msa::Error& e) {
        response["render"].push_back({{"error", e.what()}});
      }
    }
    std::ofstream out(argv[2]);
    out << response.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
    return out ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "tokenizer tool: " << e.what() << "\n";
    return 1;
  }
}
