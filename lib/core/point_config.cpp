#include "lib/core/point_config.hpp"

#include <algorithm>

#include "lib/core/errors.hpp"

namespace xfb {

std::string scope_name(Scope s) { return s == Scope::Attention ? "attention" : "layer"; }

Scope parse_scope(const std::string& name) {
  for (Scope s : {Scope::Attention, Scope::Layer})
    if (scope_name(s) == name) return s;
  throw InputError("unknown --scope '" + name + "' (known: attention, layer)");
}

std::string ffn_name(FfnKind kind) {
  switch (kind) {
    case FfnKind::Dense:
      return "dense";
    case FfnKind::Switch:
      return "switch";
    case FfnKind::Gshard:
      return "gshard";
  }
  return "dense";
}

FfnKind parse_ffn(const std::string& name) {
  for (FfnKind kind : {FfnKind::Dense, FfnKind::Switch, FfnKind::Gshard})
    if (ffn_name(kind) == name) return kind;
  throw InputError("unknown --ffn '" + name + "' (known: dense, switch, gshard)");
}

int ffn_top_k(FfnKind kind) { return kind == FfnKind::Dense ? 0 : kind == FfnKind::Switch ? 1 : 2; }

std::string status_name(Status s) {
  switch (s) {
    case Status::Ok:
      return "ok";
    case Status::Skipped:
      return "skipped";
    case Status::Unsupported:
      return "unsupported";
    case Status::Error:
      return "error";
  }
  return "error";
}

Status parse_status(const std::string& name) {
  for (Status s : {Status::Ok, Status::Skipped, Status::Unsupported, Status::Error})
    if (status_name(s) == name) return s;
  throw InputError("unknown status '" + name + "'");
}

std::string pass_name(Pass p) {
  switch (p) {
    case Pass::Forward:
      return "forward";
    case Pass::Backward:
      return "backward";
    case Pass::Train:
      return "train";
    case Pass::Decode:
      return "decode";
  }
  return "forward";
}

Pass parse_pass(const std::string& name) {
  for (Pass p : {Pass::Forward, Pass::Backward, Pass::Train, Pass::Decode})
    if (pass_name(p) == name) return p;
  throw InputError("unknown --pass '" + name + "' (known: forward, backward, train, decode)");
}

std::vector<Pass> parse_passes(const std::string& list) {
  std::vector<Pass> passes;
  std::size_t start = 0;
  while (start <= list.size()) {
    const std::size_t comma = std::min(list.find(',', start), list.size());
    const Pass pass = parse_pass(list.substr(start, comma - start));
    if (std::find(passes.begin(), passes.end(), pass) != passes.end())
      throw InputError("--pass lists " + pass_name(pass) + " twice");
    passes.push_back(pass);
    start = comma + 1;
  }
  return passes;
}

std::string pass_list_name(const std::vector<Pass>& passes) {
  std::string list;
  for (Pass pass : passes) {
    if (!list.empty()) list += ',';
    list += pass_name(pass);
  }
  return list;
}

}  // namespace xfb
