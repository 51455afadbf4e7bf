#include "apps/report/point_fields.hpp"

#include <charconv>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "lib/core/decimal.hpp"
#include "lib/core/errors.hpp"
#include "lib/core/token_count.hpp"

namespace xfb {
namespace {

using nlohmann::json;
using Words = std::vector<std::string>;

constexpr std::int64_t kMaxInt32 = std::numeric_limits<std::int32_t>::max();
constexpr std::int64_t kMaxTensorElements = std::int64_t{1} << 36;
constexpr std::int64_t kMaxQuadraticWork = std::int64_t{1} << 56;
constexpr std::int64_t kMaxSamples = std::int64_t{1} << 27;

std::string real_text(double value) {
  char text[32];
  const auto result = std::to_chars(text, text + sizeof text, value);
  return std::string(text, result.ptr);
}

std::string value_text(const json& value) { return value.is_string() ? value.get<std::string>() : value.dump(); }

// The word(s) of a field that is always spelled out: `--flag value`.
Words always_words(const std::string& flag, const json& value) { return {flag, value_text(value)}; }

// An int64 field of the point, recorded in the row's `row_member` (nullptr: not in rows).
PointField integer(std::string key, std::string flags, std::int64_t min, std::int64_t max, std::string help,
                   std::function<std::int64_t&(PointConfig&)> member, std::int64_t ResultRow::*row_member = nullptr) {
  PointField f;
  f.key = std::move(key);
  f.flags = std::move(flags);
  f.type = FieldType::Integer;
  f.min = min;
  f.max = max;
  f.help = std::move(help);
  f.get = [member](PointConfig c) { return json(member(c)); };
  f.set = [member](PointConfig& c, const json& v) { member(c) = v.get<std::int64_t>(); };
  if (row_member != nullptr) {
    f.to_row = [row_member](ResultRow& r, const json& v) { r.*row_member = v.get<std::int64_t>(); };
    f.from_row = [row_member](const ResultRow& r) { return json(r.*row_member); };
  }
  return f;
}

// An int-typed member (threads, timing counts) read and written through int64.
PointField small_integer(std::string key, std::string flags, std::int64_t min, std::int64_t max, std::string help,
                         std::function<int&(PointConfig&)> member) {
  PointField f = integer(std::move(key), std::move(flags), min, max, std::move(help), nullptr);
  f.get = [member](PointConfig c) { return json(member(c)); };
  f.set = [member](PointConfig& c, const json& v) { member(c) = static_cast<int>(v.get<std::int64_t>()); };
  return f;
}

// What is measured: the model and the problem's shape.
void identity_fields(std::vector<PointField>& fields) {
  PointField model;
  model.key = "model";
  model.flags = "--model,-m";
  model.type = FieldType::Text;
  model.help = "model name (see `xfbench list`)";
  model.use = FieldUse::RunOnly;
  model.in_settings = false;
  model.get = [](const PointConfig& c) { return json(c.model); };
  model.set = [](PointConfig& c, const json& v) { c.model = v.get<std::string>(); };
  model.to_row = [](ResultRow& r, const json& v) { r.model = v.get<std::string>(); };
  model.from_row = [](const ResultRow& r) { return json(r.model); };
  fields.push_back(model);

  PointField seq_len = integer(
      "seq_len", "--seq-len,-n", 1, kMaxInt32, "tokens N",
      [](PointConfig& c) -> std::int64_t& { return c.problem.seq_len; }, &ResultRow::seq_len);
  seq_len.type = FieldType::Length;
  seq_len.use = FieldUse::RunOnly;
  seq_len.in_settings = false;
  fields.push_back(seq_len);

  PointField batch = integer(
      "batch", "--batch,-b", 1, 1 << 20, "sequences per call",
      [](PointConfig& c) -> std::int64_t& { return c.problem.batch; }, &ResultRow::batch);
  fields.push_back(batch);

  PointField heads = integer(
      "heads", "--heads", 1, 1 << 20, "attention heads",
      [](PointConfig& c) -> std::int64_t& { return c.problem.heads; }, &ResultRow::heads);
  fields.push_back(heads);

  PointField head_dim = integer(
      "head_dim", "--head-dim,-d", 1, 1 << 20, "features per head",
      [](PointConfig& c) -> std::int64_t& { return c.problem.head_dim; }, &ResultRow::head_dim);
  fields.push_back(head_dim);
}

// Words of a mixture-of-experts field: spelled only when the FFN is one.
std::function<Words(const PointConfig&)> moe_words(std::string flag, std::function<json(const PointConfig&)> value) {
  return [flag = std::move(flag), value = std::move(value)](const PointConfig& c) {
    return c.ffn.kind == FfnKind::Dense ? Words{} : always_words(flag, value(c));
  };
}

// The layer's FFN sublayer: dense, or a mixture of experts and its settings (recorded as 0 for dense).
void moe_fields(std::vector<PointField>& fields) {
  PointField ffn;
  ffn.key = "ffn";
  ffn.flags = "--ffn";
  ffn.type = FieldType::Choice;
  ffn.choices = {"dense", "switch", "gshard"};
  ffn.help =
      "layer scope FFN sublayer: dense, switch (top-1 mixture of experts) or gshard (top-2), with any attention "
      "model (docs/layer.md#mixture-of-experts)";
  ffn.get = [](const PointConfig& c) { return json(ffn_name(c.ffn.kind)); };
  ffn.set = [](PointConfig& c, const json& v) { c.ffn.kind = parse_ffn(v.get<std::string>()); };
  ffn.words = moe_words("--ffn", ffn.get);
  ffn.to_row = [](ResultRow& r, const json& v) { r.ffn = v.get<std::string>(); };
  ffn.from_row = [](const ResultRow& r) { return json(r.ffn); };
  fields.push_back(ffn);

  auto moe_only = [](PointField& f, std::function<json(const PointConfig&)> value) {
    f.recorded = [value](const PointConfig& c) { return c.ffn.kind == FfnKind::Dense ? json(0) : value(c); };
    f.words = moe_words(f.long_flag(), value);
  };
  PointField experts = integer(
      "experts", "--experts", 1, 1 << 16, "mixture of experts: experts X (gshard: at least 2)",
      [](PointConfig& c) -> std::int64_t& { return c.ffn.experts; }, &ResultRow::experts);
  moe_only(experts, experts.get);
  fields.push_back(experts);

  PointField capacity;
  capacity.key = "capacity_factor";
  capacity.flags = "--capacity-factor";
  capacity.type = FieldType::Real;
  capacity.real_min = 0;
  capacity.real_max = 1 << 16;
  capacity.help = "mixture of experts: expert capacity as a multiple of a group's even share k·S/X (> 0)";
  capacity.get = [](const PointConfig& c) { return json(c.ffn.capacity_factor); };
  capacity.set = [](PointConfig& c, const json& v) { c.ffn.capacity_factor = v.get<double>(); };
  capacity.to_row = [](ResultRow& r, const json& v) { r.capacity_factor = v.get<double>(); };
  capacity.from_row = [](const ResultRow& r) { return json(r.capacity_factor); };
  moe_only(capacity, capacity.get);
  fields.push_back(capacity);

  PointField group = integer(
      "group_size", "--group-size", 0, kMaxInt32,
      "mixture of experts: tokens S per routing group, consecutive rows (0: all batch·seq-len rows)",
      [](PointConfig& c) -> std::int64_t& { return c.ffn.group_size; }, &ResultRow::group_size);
  moe_only(group, group.get);
  fields.push_back(group);
}

// What is timed: scope, pass, decode tokens, causality, the layer's FFN width.
void pass_fields(std::vector<PointField>& fields) {
  PointField scope;
  scope.key = "scope";
  scope.flags = "--scope";
  scope.type = FieldType::Choice;
  scope.choices = {"attention", "layer"};
  scope.help = "attention (the mechanism alone) or layer (pre-LN encoder layer)";
  scope.get = [](const PointConfig& c) { return json(scope_name(c.scope)); };
  scope.set = [](PointConfig& c, const json& v) { c.scope = parse_scope(v.get<std::string>()); };
  scope.to_row = [](ResultRow& r, const json& v) { r.scope = parse_scope(v.get<std::string>()); };
  scope.from_row = [](const ResultRow& r) { return json(scope_name(r.scope)); };
  fields.push_back(scope);

  PointField pass;
  pass.key = "pass";
  pass.flags = "--pass";
  pass.type = FieldType::Choice;
  pass.choices = {"forward", "backward", "train", "decode"};
  pass.help =
      "forward, backward (after an untimed forward), train (forward + backward as one step) or decode (prefill "
      "the N-token context, then time --decode-tokens steps of one token; causal); sweep and ab: also a list, "
      "e.g. forward,train";
  pass.get = [](const PointConfig& c) { return json(pass_name(c.pass)); };
  pass.set = [](PointConfig& c, const json& v) { c.pass = parse_pass(v.get<std::string>()); };
  pass.words = [](const PointConfig& c) {
    return c.pass == Pass::Forward ? Words{} : Words{"--pass", pass_name(c.pass)};
  };
  pass.to_row = [](ResultRow& r, const json& v) { r.pass = parse_pass(v.get<std::string>()); };
  pass.from_row = [](const ResultRow& r) { return json(pass_name(r.pass)); };
  fields.push_back(pass);

  PointField decode_tokens = integer(
      "decode_tokens", "--decode-tokens", 1, 1 << 20, "decode pass: tokens generated one at a time after the context",
      [](PointConfig& c) -> std::int64_t& { return c.decode_tokens; }, &ResultRow::decode_tokens);
  decode_tokens.type = FieldType::Length;
  decode_tokens.recorded = [](const PointConfig& c) { return json(c.pass == Pass::Decode ? c.decode_tokens : 0); };
  decode_tokens.words = [](const PointConfig& c) {
    return c.pass == Pass::Decode ? Words{"--decode-tokens", std::to_string(c.decode_tokens)} : Words{};
  };
  fields.push_back(decode_tokens);

  PointField causal;
  causal.key = "causal";
  causal.flags = "--causal";
  causal.type = FieldType::Flag;
  causal.help = "causal (decoder) attention: token i sees j <= i";
  causal.get = [](const PointConfig& c) { return json(c.problem.causal); };
  causal.set = [](PointConfig& c, const json& v) { c.problem.causal = v.get<bool>(); };
  causal.words = [](const PointConfig& c) { return c.problem.causal ? Words{"--causal"} : Words{}; };
  causal.to_row = [](ResultRow& r, const json& v) { r.causal = v.get<bool>(); };
  causal.from_row = [](const ResultRow& r) { return json(r.causal); };
  fields.push_back(causal);

  PointField d_ff = integer(
      "d_ff", "--d-ff", 0, kMaxInt32, "layer scope FFN width (0: 4·heads·head-dim)",
      [](PointConfig& c) -> std::int64_t& { return c.d_ff; }, &ResultRow::d_ff);
  d_ff.recorded = [](const PointConfig& c) { return json(c.scope == Scope::Layer ? c.effective_d_ff() : 0); };
  d_ff.words = [](const PointConfig& c) {
    return c.scope == Scope::Layer ? Words{"--d-ff", std::to_string(c.effective_d_ff())} : Words{};
  };
  fields.push_back(d_ff);
  moe_fields(fields);
}

// How it runs: threads, seed, the mechanism's parameters.
void run_fields(std::vector<PointField>& fields) {
  PointField threads =
      small_integer("threads", "--threads,-t", 1, 4096, "threads for oneDNN and OpenMP loops, every core by default",
                    [](PointConfig& c) -> int& { return c.problem.threads; });
  threads.to_row = [](ResultRow& r, const json& v) { r.threads = static_cast<int>(v.get<std::int64_t>()); };
  threads.from_row = [](const ResultRow& r) { return json(r.threads); };
  fields.push_back(threads);

  PointField seed;
  seed.key = "seed";
  seed.flags = "--seed";
  seed.type = FieldType::Unsigned;
  seed.help = "seed of inputs and parameters (0 … 2^64−1)";
  seed.get = [](const PointConfig& c) { return json(c.seed); };
  seed.set = [](PointConfig& c, const json& v) { c.seed = v.get<std::uint64_t>(); };
  seed.to_row = [](ResultRow& r, const json& v) { r.seed = v.get<std::uint64_t>(); };
  seed.from_row = [](const ResultRow& r) { return json(r.seed); };
  fields.push_back(seed);

  PointField params;
  params.key = "params";
  params.flags = "--param,-p";
  params.type = FieldType::TextList;
  params.help = "mechanism parameter key=value (repeatable)";
  params.in_settings = false;  // a sweep records its own list (model.key=value included)
  params.in_key = false;       // rows carry the resolved values; point_key adds them
  params.get = [](const PointConfig& c) { return json(c.params); };
  params.set = [](PointConfig& c, const json& v) { c.params = v.get<std::vector<std::string>>(); };
  params.words = [](const PointConfig& c) {
    Words words;
    for (const auto& param : c.params) words.insert(words.end(), {"--param", param});
    return words;
  };
  fields.push_back(params);
}

// How it is timed: warm-up and repetitions.
void timing_fields(std::vector<PointField>& fields) {
  PointField warmup = small_integer("warmup", "--warmup", 1, 1000000,
                                    "untimed runs before timing (>= 1: primitives are created in warm-up)",
                                    [](PointConfig& c) -> int& { return c.timing.warmup; });
  warmup.in_key = false;
  fields.push_back(warmup);

  PointField min_reps = small_integer("min_reps", "--min-reps", 1, 10000000, "timed repetitions, at least",
                                      [](PointConfig& c) -> int& { return c.timing.min_reps; });
  min_reps.in_key = false;
  fields.push_back(min_reps);

  PointField min_time;
  min_time.key = "min_time_s";
  min_time.flags = "--min-time";
  min_time.type = FieldType::Real;
  min_time.real_min = 0;
  min_time.real_max = 86400;
  min_time.help = "seconds of timed repetitions, at least";
  min_time.in_key = false;
  min_time.get = [](const PointConfig& c) { return json(c.timing.min_time_s); };
  min_time.set = [](PointConfig& c, const json& v) { c.timing.min_time_s = v.get<double>(); };
  min_time.words = [](const PointConfig& c) { return Words{"--min-time", real_text(c.timing.min_time_s)}; };
  fields.push_back(min_time);

  PointField max_reps = small_integer("max_reps", "--max-reps", 1, 10000000, "timed repetitions, at most",
                                      [](PointConfig& c) -> int& { return c.timing.max_reps; });
  max_reps.in_key = false;
  // Spelled out only when it differs from the default, so reproducers of default points read as before.
  max_reps.words = [](const PointConfig& c) {
    return c.timing.max_reps == TimingSettings{}.max_reps ? Words{}
                                                          : Words{"--max-reps", std::to_string(c.timing.max_reps)};
  };
  fields.push_back(max_reps);
}

// The element type of q, k, v, out and the decode state (issue 31). Part of the key: a bf16 and an
// f32 row of one point are different points; a row that predates the field reads as f32.
PointField dtype_field() {
  PointField dtype;
  dtype.key = "dtype";
  dtype.flags = "--dtype";
  dtype.type = FieldType::Choice;
  dtype.choices = {"f32", "bf16"};
  dtype.help =
      "element type of q, k, v, the output and the decode state: f32, or bf16 (fp32 accumulation and softmax "
      "statistics; models without a bf16 form give unsupported rows)";
  dtype.get = [](const PointConfig& c) { return json(dtype_name(c.problem.dtype)); };
  dtype.set = [](PointConfig& c, const json& v) { c.problem.dtype = parse_dtype(v.get<std::string>()); };
  // Spelled out only for bf16, so the reproducers of f32 points read as before.
  dtype.words = [](const PointConfig& c) {
    return c.problem.dtype == DType::F32 ? Words{} : Words{"--dtype", dtype_name(c.problem.dtype)};
  };
  dtype.to_row = [](ResultRow& r, const json& v) { r.dtype = parse_dtype(v.get<std::string>()); };
  dtype.from_row = [](const ResultRow& r) { return json(dtype_name(r.dtype)); };
  return dtype;
}

// Fills what a field may leave unset: `recorded` (the value as given), `words` (`--flag value`).
PointField completed(PointField f) {
  if (!f.recorded) f.recorded = f.get;
  if (!f.words) {
    const std::string flag = f.long_flag();
    f.words = [flag, recorded = f.recorded](const PointConfig& c) { return always_words(flag, recorded(c)); };
  }
  return f;
}

std::vector<PointField> make_fields() {
  std::vector<PointField> fields;
  identity_fields(fields);
  pass_fields(fields);
  fields.push_back(dtype_field());
  run_fields(fields);
  timing_fields(fields);
  for (auto& field : fields) field = completed(std::move(field));
  return fields;
}

std::string range_text(const PointField& f) {
  switch (f.type) {
    case FieldType::Integer:
      return "an integer in [" + std::to_string(f.min) + ", " + std::to_string(f.max) + "]";
    case FieldType::Length:
      return "a token count in [" + std::to_string(f.min) + ", " + std::to_string(f.max) +
             "] (digits, or with K or M: 4K)";
    case FieldType::Unsigned:
      return "an integer in [0, 18446744073709551615]";
    case FieldType::Real:
      return "a finite number in [" + real_text(f.real_min) + ", " + real_text(f.real_max) + "]";
    case FieldType::Flag:
      return "true or false";
    case FieldType::Choice: {
      std::string text = "one of ";
      for (std::size_t i = 0; i < f.choices.size(); ++i) text += (i ? ", " : "") + f.choices[i];
      return text;
    }
    case FieldType::Text:
      return "a non-empty string";
    case FieldType::TextList:
      return "a list of strings";
  }
  return "";
}

[[noreturn]] void refuse(const PointField& f, const std::string& where, const std::string& got) {
  throw InputError(where + " must be " + range_text(f) + ", got " + got);
}

void check_limit(std::initializer_list<std::int64_t> factors, std::int64_t limit, const std::string& what) {
  const std::int64_t value = checked_product(factors);
  if (value < 0 || value > limit)
    throw InputError(what + " exceeds the limit of " + std::to_string(limit) + " (docs/cli.md#limits)");
}

}  // namespace

std::int64_t checked_product(std::initializer_list<std::int64_t> factors) {
  std::int64_t result = 1;
  for (std::int64_t factor : factors)
    if (__builtin_mul_overflow(result, factor, &result)) return -1;
  return result;
}

std::string PointField::long_flag() const { return flags.substr(0, flags.find(',')); }

const std::vector<PointField>& point_fields() {
  static const std::vector<PointField> fields = make_fields();
  return fields;
}

const PointField& point_field(const std::string& key) {
  for (const auto& field : point_fields())
    if (field.key == key) return field;
  throw std::logic_error("point_field: no field '" + key + "'");
}

json parse_field_text(const PointField& f, const std::string& text) {
  const std::string where = f.long_flag();
  const char* begin = text.data();
  const char* end = begin + text.size();
  switch (f.type) {
    case FieldType::Integer: {
      std::int64_t value = 0;
      const auto [ptr, ec] = std::from_chars(begin, end, value);
      if (ec != std::errc() || ptr != end || value < f.min || value > f.max) refuse(f, where, "'" + text + "'");
      return value;
    }
    case FieldType::Length: {
      const auto value = parse_token_count(text);
      if (!value || *value < f.min || *value > f.max) refuse(f, where, "'" + text + "'");
      return *value;
    }
    case FieldType::Unsigned: {
      std::uint64_t value = 0;
      const auto [ptr, ec] = std::from_chars(begin, end, value);
      if (ec != std::errc() || ptr != end) refuse(f, where, "'" + text + "'");
      return value;
    }
    case FieldType::Real: {
      const auto value = parse_decimal(text);
      if (!value || *value < f.real_min || *value > f.real_max) refuse(f, where, "'" + text + "'");
      return *value;
    }
    case FieldType::Flag:
      if (text == "true") return true;
      if (text == "false") return false;
      refuse(f, where, "'" + text + "'");
    case FieldType::Choice:
      for (const auto& choice : f.choices)
        if (choice == text) return text;
      refuse(f, where, "'" + text + "'");
    case FieldType::Text:
      if (text.empty()) refuse(f, where, "an empty string");
      return text;
    case FieldType::TextList:
      return json::array({text});
  }
  refuse(f, where, "'" + text + "'");
}

void check_field_value(const PointField& f, const json& v, const std::string& where) {
  const std::string got = v.dump().substr(0, 60);
  switch (f.type) {
    case FieldType::Integer:
    case FieldType::Length:
      if (!v.is_number_integer() ||
          (v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(f.max)) ||
          v.get<std::int64_t>() < f.min || v.get<std::int64_t>() > f.max)
        refuse(f, where, got);
      return;
    case FieldType::Unsigned:
      if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<std::int64_t>() >= 0)) refuse(f, where, got);
      return;
    case FieldType::Real:
      if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < f.real_min ||
          v.get<double>() > f.real_max)
        refuse(f, where, got);
      return;
    case FieldType::Flag:
      if (!v.is_boolean()) refuse(f, where, got);
      return;
    case FieldType::Choice:
      if (!v.is_string()) refuse(f, where, got);
      for (const auto& choice : f.choices)
        if (choice == v.get<std::string>()) return;
      refuse(f, where, got);
    case FieldType::Text:
      if (!v.is_string() || v.get<std::string>().empty()) refuse(f, where, got);
      return;
    case FieldType::TextList:
      if (!v.is_array()) refuse(f, where, got);
      for (const auto& item : v)
        if (!item.is_string()) refuse(f, where, got);
      return;
  }
}

PointConfig apply_field_texts(PointConfig config, const FieldTexts& texts) {
  for (const auto& [key, words] : texts) {
    const PointField& f = point_field(key);
    if (words.empty()) continue;
    if (f.type == FieldType::TextList) {
      f.set(config, json(words));
      continue;
    }
    if (words.size() > 1) throw InputError(f.long_flag() + " is given " + std::to_string(words.size()) + " times");
    f.set(config, parse_field_text(f, words.front()));
  }
  check_point_config(config);
  return config;
}

void check_point_config(const PointConfig& c) {
  const Problem& p = c.problem;
  if (c.timing.min_reps > c.timing.max_reps)
    throw InputError("--min-reps " + std::to_string(c.timing.min_reps) + " exceeds --max-reps " +
                     std::to_string(c.timing.max_reps));
  if (c.pass == Pass::Decode && c.scope != Scope::Attention)
    throw InputError("--pass decode runs in attention scope only");
  const std::int64_t tokens = p.seq_len + (c.pass == Pass::Decode ? c.decode_tokens : 0);
  check_limit({p.batch, p.heads, tokens, p.head_dim}, kMaxTensorElements,
              "one [--batch, --heads, --seq-len + --decode-tokens, --head-dim] tensor's element count");
  check_limit({p.batch, p.heads, tokens, tokens, p.head_dim}, kMaxQuadraticWork,
              "--batch × --heads × (--seq-len + --decode-tokens)² × --head-dim");
  if (c.ffn.kind != FfnKind::Dense) {
    const std::string ffn = "--ffn " + ffn_name(c.ffn.kind);
    if (c.scope != Scope::Layer) throw InputError(ffn + " runs in layer scope only (--scope layer)");
    if (!(c.ffn.capacity_factor > 0)) throw InputError("--capacity-factor must be > 0, got 0");
    if (c.ffn.kind == FfnKind::Gshard && c.ffn.experts < 2)
      throw InputError(ffn + " routes to two experts: --experts must be at least 2, got 1");
    check_limit({p.batch, p.seq_len}, std::int64_t{1} << 24, ffn + ": --batch × --seq-len (routed rows)");
  }
  if (c.scope == Scope::Layer) {
    check_limit({p.heads, p.head_dim, c.effective_d_ff()}, kMaxTensorElements,
                "a layer's --heads × --head-dim × --d-ff");
    check_limit({p.batch, p.seq_len, p.heads, p.head_dim, c.effective_d_ff()}, kMaxQuadraticWork,
                "a layer's --batch × --seq-len × --heads × --head-dim × --d-ff");
  }
  const std::int64_t samples_per_run = c.pass == Pass::Decode ? c.decode_tokens : 1;
  check_limit({c.timing.max_reps, samples_per_run}, kMaxSamples, "--max-reps × --decode-tokens (timed samples kept)");
}

json point_to_json(const PointConfig& config) {
  json point = json::object();
  for (const auto& field : point_fields()) point[field.key] = field.get(config);
  return point;
}

PointConfig point_from_json(const json& point) {
  if (!point.is_object()) throw InputError("the point must be a JSON object");
  for (const auto& [key, value] : point.items()) {
    bool known = false;
    for (const auto& field : point_fields()) known = known || field.key == key;
    if (!known) throw InputError("the point has an unknown field '" + key + "'");
  }
  PointConfig config;
  for (const auto& field : point_fields()) {
    if (!point.contains(field.key)) throw InputError("the point has no field '" + field.key + "'");
    check_field_value(field, point[field.key], "point field " + field.key);
    field.set(config, point[field.key]);
  }
  check_point_config(config);
  return config;
}

std::vector<std::string> point_arguments(const PointConfig& config) {
  std::vector<std::string> args = {"run"};
  for (const auto& field : point_fields()) {
    const auto words = field.words(config);
    args.insert(args.end(), words.begin(), words.end());
  }
  return args;
}

json point_settings(const PointConfig& config) {
  json settings = json::object();
  for (const auto& field : point_fields())
    if (field.in_settings) settings[field.key] = field.recorded(config);
  return settings;
}

void set_row_identity(ResultRow& row, const PointConfig& config) {
  for (const auto& field : point_fields())
    if (field.to_row) field.to_row(row, field.recorded(config));
}

std::string point_key(const ResultRow& row) {
  std::string key;
  for (const auto& field : point_fields())
    if (field.in_key && field.from_row) key += field.key + "=" + field.from_row(row).dump() + "|";
  return key + "params=" + row.params.dump();
}

}  // namespace xfb
