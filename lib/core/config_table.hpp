#pragma once
// Typed model configuration: a model keeps its parameters in one plain config struct (defaults as
// default member initialisers, a unit comment per field) and describes it by a field table —
// name, member, range or choices, meaning. The table gives the command-line specs (defaults read
// from the struct itself), reads parsed values into the struct and writes a struct back as values.
//
// A ModelSpec joins the table with the model's functions, all on the typed config:
//   resolve     the config as it runs on a problem: derived defaults computed (0 = "from N"),
//               blocks clamped to N. Optional (identity). Every other function gets its result.
//   validate    throws ParamError (one line) for a combination the ranges cannot express; called
//               before anything runs or is written. Optional.
//   unsupported why a valid combination cannot run ("" when it can): an `unsupported` row. Optional.
//   create, flops (executed FLOPs of one forward, equal to the counter), workspace (tracked bytes
//   beyond inputs and output, per-thread buffers for Problem::threads threads).
//   backward_flops, backward_workspace: the same for the backward pass (what prepare_backward adds);
//               both set exactly when the mechanism implements the backward contract.
//   decode_workspace: tracked bytes prepare_decode(tokens) adds (state at capacity, step buffers);
//               set exactly when the mechanism implements the decode contract.
// implement() erases the config type into the registry's Implementation.
#include <cstdint>
#include <functional>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "lib/core/mechanism.hpp"
#include "lib/core/params.hpp"

namespace xfb {

template <class Config>
struct Field {
  ParamSpec spec;                                        // name, type, default, range or choices, help
  std::function<void(Config&, const ParamValues&)> read;  // parsed values → struct
  std::function<ParamValue(const Config&)> write;         // struct → value of the spec's type
};

template <class Config>
using FieldTable = std::vector<Field<Config>>;

// An integer field in [min, max].
template <class Config>
Field<Config> int_field(std::string name, std::int64_t Config::*member, std::int64_t min, std::int64_t max,
                        std::string help) {
  return {{name, ParamType::Int, std::to_string(Config{}.*member), static_cast<double>(min),
           static_cast<double>(max), {}, std::move(help)},
          [name, member](Config& c, const ParamValues& v) { c.*member = v.get_int(name); },
          [member](const Config& c) { return ParamValue(c.*member); }};
}

// A real field in [min, max].
template <class Config>
Field<Config> real_field(std::string name, double Config::*member, double min, double max, std::string help) {
  std::ostringstream text;
  text << Config{}.*member;
  return {{name, ParamType::Float, text.str(), min, max, {}, std::move(help)},
          [name, member](Config& c, const ParamValues& v) { c.*member = v.get_float(name); },
          [member](const Config& c) { return ParamValue(c.*member); }};
}

// A true/false field.
template <class Config>
Field<Config> flag_field(std::string name, bool Config::*member, std::string help) {
  return {{name, ParamType::Bool, Config{}.*member ? "true" : "false", 0, 0, {}, std::move(help)},
          [name, member](Config& c, const ParamValues& v) { c.*member = v.get_bool(name); },
          [member](const Config& c) { return ParamValue(c.*member); }};
}

// A field with named choices, each standing for one value of the member (a string, an enum, a
// number or a flag). The struct's default must be one of them.
template <class Config, class T>
Field<Config> choice_field(std::string name, T Config::*member, std::vector<std::pair<std::string, T>> choices,
                           std::string help) {
  auto name_of = [choices](const T& value) {
    for (const auto& [text, choice] : choices)
      if (choice == value) return text;
    throw std::logic_error("choice_field: a value without a name");
  };
  std::vector<std::string> names;
  for (const auto& choice : choices) names.push_back(choice.first);
  return {{name, ParamType::Choice, name_of(Config{}.*member), 0, 0, names, std::move(help)},
          [name, member, choices](Config& c, const ParamValues& v) {
            const std::string& text = v.get_choice(name);
            for (const auto& [choice_name, value] : choices)
              if (choice_name == text) c.*member = value;
          },
          [member, name_of](const Config& c) { return ParamValue(name_of(c.*member)); }};
}

template <class Config>
struct ModelSpec {
  FieldTable<Config> fields;
  std::unique_ptr<Mechanism> (*create)(const Problem&, const Config&, std::uint64_t seed) = nullptr;
  std::int64_t (*flops)(const Problem&, const Config&) = nullptr;
  std::int64_t (*workspace)(const Problem&, const Config&) = nullptr;
  Config (*resolve)(const Problem&, Config) = nullptr;
  void (*validate)(const Problem&, const Config&) = nullptr;
  std::string (*unsupported)(const Problem&, const Config&) = nullptr;
  std::int64_t (*backward_flops)(const Problem&, const Config&) = nullptr;
  std::int64_t (*backward_workspace)(const Problem&, const Config&) = nullptr;
  std::int64_t (*decode_workspace)(const Problem&, const Config&, std::int64_t tokens) = nullptr;
};

template <class Config>
Config read_config(const FieldTable<Config>& fields, const ParamValues& values) {
  Config config{};
  for (const auto& field : fields) field.read(config, values);
  return config;
}

template <class Config>
ParamValues write_config(const FieldTable<Config>& fields, const Config& config) {
  ParamValues values;
  for (const auto& field : fields) values.set(field.spec.name, field.write(config));
  return values;
}

template <class Config>
Implementation implement(const ModelSpec<Config>& spec) {
  // The config a problem runs with: read, then resolved for the problem.
  auto running = [spec](const Problem& p, const ParamValues& values) {
    const Config config = read_config(spec.fields, values);
    return spec.resolve ? spec.resolve(p, config) : config;
  };
  Implementation impl;
  for (const auto& field : spec.fields) impl.params.push_back(field.spec);
  impl.create = [spec, running](const Problem& p, const ParamValues& v, std::uint64_t seed) {
    return spec.create(p, running(p, v), seed);
  };
  impl.flops = [spec, running](const Problem& p, const ParamValues& v) { return spec.flops(p, running(p, v)); };
  impl.workspace_bytes = [spec, running](const Problem& p, const ParamValues& v) {
    return spec.workspace(p, running(p, v));
  };
  impl.resolved = [spec, running](const Problem& p, const ParamValues& v) {
    return write_config(spec.fields, running(p, v));
  };
  // Validation sees the values as given (a 0 meaning "from N" is still 0).
  if (spec.validate)
    impl.validate = [spec](const Problem& p, const ParamValues& v) { spec.validate(p, read_config(spec.fields, v)); };
  if (spec.unsupported)
    impl.unsupported = [spec](const Problem& p, const ParamValues& v) {
      return spec.unsupported(p, read_config(spec.fields, v));
    };
  if (static_cast<bool>(spec.backward_flops) != static_cast<bool>(spec.backward_workspace))
    throw std::logic_error("ModelSpec: backward_flops and backward_workspace go together");
  if (spec.backward_flops) {
    impl.backward_flops = [spec, running](const Problem& p, const ParamValues& v) {
      return spec.backward_flops(p, running(p, v));
    };
    impl.backward_workspace_bytes = [spec, running](const Problem& p, const ParamValues& v) {
      return spec.backward_workspace(p, running(p, v));
    };
  }
  if (spec.decode_workspace)
    impl.decode_workspace_bytes = [spec, running](const Problem& p, const ParamValues& v, std::int64_t tokens) {
      return spec.decode_workspace(p, running(p, v), tokens);
    };
  return impl;
}

}  // namespace xfb
