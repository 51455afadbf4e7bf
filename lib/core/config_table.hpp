#pragma once
// Typed model configuration: a model keeps its parameters in one plain config struct (defaults as
// default member initialisers, a unit comment per field) and describes it by a field table —
// name, member, range or choices, meaning. The table gives the command-line specs (defaults read
// from the struct itself), reads parsed values into the struct and writes a struct back as values.
//
// A model's functions are free functions in namespace xfb overloaded on its config type, found by
// implement<Config>() through argument-dependent lookup where it is instantiated (the model's
// .cpp); the optional ones are detected, never registered by hand:
//   config_fields(const Config*)  the field table. Optional (no parameters).
//   resolve     the config as it runs on a problem: derived defaults computed (0 = "from N"),
//               blocks clamped to N. Optional (identity). Every other function gets its result.
//   validate    throws ParamError (one line) for a combination the ranges cannot express; called
//               before anything runs or is written. Optional.
//   unsupported why a valid combination cannot run ("" when it can): an `unsupported` row. Optional.
//   create, flops (executed FLOPs of one forward, equal to the counter), workspace (tracked bytes
//   beyond inputs and output, per-thread buffers for Problem::threads threads). Required.
//   backward_flops, backward_workspace: the same for the backward pass (what prepare_backward adds);
//               defined exactly when the mechanism implements the backward contract (both or neither).
//   decode_workspace: tracked bytes prepare_decode(tokens) adds (state at capacity, step buffers);
//               defined exactly when the mechanism implements the decode contract.
//   output_rows: M, the output's rows per (batch, head), for a downsampling model (M < N possible).
//               Optional (M = N).
// implement<Config>() erases the config type into the registry's Implementation; the model's .cpp
// defines implementation<Config>() with it, and its header declares that specialisation.
#include <concepts>
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
  ParamSpec spec;                                         // name, type, default, range or choices, help
  std::function<void(Config&, const ParamValues&)> read;  // parsed values → struct
  std::function<ParamValue(const Config&)> write;         // struct → value of the spec's type
};

template <class Config>
using FieldTable = std::vector<Field<Config>>;

// An integer field in [min, max].
template <class Config>
Field<Config> int_field(std::string name, std::int64_t Config::*member, std::int64_t min, std::int64_t max,
                        std::string help) {
  return {{name,
           ParamType::Int,
           std::to_string(Config{}.*member),
           static_cast<double>(min),
           static_cast<double>(max),
           {},
           std::move(help)},
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

// The optional functions of a model, detected on its config type.
template <class Config>
concept HasFields = requires(const Config* tag) {
  { config_fields(tag) } -> std::convertible_to<FieldTable<Config>>;
};
template <class Config>
concept HasResolve = requires(const Problem& p, const Config& c) {
  { resolve(p, c) } -> std::same_as<Config>;
};
template <class Config>
concept HasValidate = requires(const Problem& p, const Config& c) {
  validate(p, c);
};
template <class Config>
concept HasUnsupported = requires(const Problem& p, const Config& c) {
  { unsupported(p, c) } -> std::convertible_to<std::string>;
};
template <class Config>
concept HasBackwardFlops = requires(const Problem& p, const Config& c) {
  { backward_flops(p, c) } -> std::same_as<std::int64_t>;
};
template <class Config>
concept HasBackwardWorkspace = requires(const Problem& p, const Config& c) {
  { backward_workspace(p, c) } -> std::same_as<std::int64_t>;
};
template <class Config>
concept HasDecode = requires(const Problem& p, const Config& c, std::int64_t tokens) {
  { decode_workspace(p, c, tokens) } -> std::same_as<std::int64_t>;
};

template <class Config>
concept HasOutputRows = requires(const Problem& p, const Config& c) {
  { output_rows(p, c) } -> std::same_as<std::int64_t>;
};

template <class Config>
FieldTable<Config> fields_of() {
  if constexpr (HasFields<Config>)
    return config_fields(static_cast<const Config*>(nullptr));
  else
    return {};
}

template <class Config>
Implementation implement() {
  static_assert(HasBackwardFlops<Config> == HasBackwardWorkspace<Config>,
                "backward_flops and backward_workspace go together");
  const FieldTable<Config> fields = fields_of<Config>();
  // The config a problem runs with: read, then resolved for the problem.
  auto running = [fields](const Problem& p, const ParamValues& values) {
    const Config config = read_config(fields, values);
    if constexpr (HasResolve<Config>)
      return resolve(p, config);
    else
      return config;
  };
  Implementation impl;
  for (const auto& field : fields) impl.params.push_back(field.spec);
  impl.create = [running](const Problem& p, const ParamValues& v, std::uint64_t seed) {
    return create(p, running(p, v), seed);
  };
  impl.flops = [running](const Problem& p, const ParamValues& v) { return flops(p, running(p, v)); };
  impl.workspace_bytes = [running](const Problem& p, const ParamValues& v) { return workspace(p, running(p, v)); };
  impl.resolved = [fields, running](const Problem& p, const ParamValues& v) {
    return write_config(fields, running(p, v));
  };
  // Validation sees the values as given (a 0 meaning "from N" is still 0).
  if constexpr (HasValidate<Config>)
    impl.validate = [fields](const Problem& p, const ParamValues& v) { validate(p, read_config(fields, v)); };
  if constexpr (HasUnsupported<Config>)
    impl.unsupported = [fields](const Problem& p, const ParamValues& v) {
      return unsupported(p, read_config(fields, v));
    };
  if constexpr (HasBackwardFlops<Config>) {
    impl.backward_flops = [running](const Problem& p, const ParamValues& v) {
      return backward_flops(p, running(p, v));
    };
    impl.backward_workspace_bytes = [running](const Problem& p, const ParamValues& v) {
      return backward_workspace(p, running(p, v));
    };
  }
  if constexpr (HasDecode<Config>)
    impl.decode_workspace_bytes = [running](const Problem& p, const ParamValues& v, std::int64_t tokens) {
      return decode_workspace(p, running(p, v), tokens);
    };
  if constexpr (HasOutputRows<Config>)
    impl.output_rows = [running](const Problem& p, const ParamValues& v) { return output_rows(p, running(p, v)); };
  return impl;
}

// The registry's entry to the model configured by Config: specialised in the model's .cpp as
// `template <> Implementation implementation<XConfig>() { return implement<XConfig>(); }` after
// its functions, declared in its header.
template <class Config>
Implementation implementation();

}  // namespace xfb
