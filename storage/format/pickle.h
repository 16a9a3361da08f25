// A restricted reader and a small writer for Python pickles: enough of the format to read and
// write PyTorch DCP metadata (`.metadata`) and the small tensor pickles inside torch.save
// records, and nothing that can run code.
//
// Reading never imports or calls anything. A GLOBAL/STACK_GLOBAL is checked against the
// caller's allow-list and becomes a kGlobal value naming it; REDUCE and NEWOBJ become kObject
// values recording the callable, its arguments and (after BUILD) its state; BINPERSID becomes a
// kPersistent value around its id. Interpreting those (a torch.Size, a dtype, a dataclass) is
// the caller's business (storage/format/torch_metadata.cc, torch_record.cc). Untrusted input is
// bounded: input size, value count, container depth, memo size, stack depth and the tree that
// shared references expand to all have limits, integers beyond 64 bits and recursive structures are
// refused. Every failure is a CorruptionError (malformed or over-limit input) or an
// UnsupportedError (a valid pickle using an opcode or a global this reader does not accept), naming
// the source, the byte offset and, for globals, the global.
//
// Thread-safe: free functions over immutable inputs; Values are not synchronised.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dcp::pickle {

enum class Kind : uint8_t {
  kNone,
  kBool,
  kInt,
  kFloat,
  kStr,
  kBytes,
  kTuple,
  kList,
  kDict,
  kGlobal,      // str = "module\nname" (see module()/name())
  kObject,      // callable(args) [+ BUILD state]
  kPersistent,  // a persistent id (BINPERSID): items[0] is the id
};

struct Value;
using ValuePtr = std::shared_ptr<Value>;

struct Value {
  Kind kind = Kind::kNone;
  bool boolean = false;
  int64_t integer = 0;
  double real = 0;
  std::string str;  // kStr (UTF-8), kBytes, kGlobal
  // kTuple, kList; kDict: key, value, key, value...; kPersistent; and a kObject made by
  // collections.OrderedDict() holds the pairs SETITEM(S) gave it, as a kDict does.
  std::vector<ValuePtr> items;
  ValuePtr callable;    // kObject: a kGlobal
  ValuePtr args;        // kObject: a kTuple
  ValuePtr state;       // kObject: set by BUILD, else null
  bool newobj = false;  // kObject: made by NEWOBJ (cls.__new__) rather than REDUCE
  // Reader bookkeeping: a value nested in another may no longer change (no cycles).
  bool frozen = false;
  uint32_t depth = 1;
  // The tree this value stands for, with every shared reference (a memo GET) counted as a copy:
  // its values and its string bytes (saturating). What walks a value walks this tree.
  uint64_t tree_values = 1;
  uint64_t tree_bytes = 0;

  std::string module() const { return str.substr(0, str.find('\n')); }
  std::string name() const {
    const size_t nl = str.find('\n');
    return nl == std::string::npos ? std::string() : str.substr(nl + 1);
  }
  /// "module.name" of a kGlobal, or of an object's callable.
  std::string global_name() const;
  /// For kDict: the value under the string key `key`, or null.
  const Value* Get(std::string_view key) const;
  /// A short description for messages ("dict", "tuple of 3", "torch.Size(...)").
  std::string Describe() const;

  // Typed reads of a plain Python value, as Python would convert it: nullopt when the kind does
  // not fit (never an exception).
  /// kFloat, kInt (as float(x)); not kBool.
  std::optional<double> AsFloat() const;
  /// kInt; not kBool.
  std::optional<int64_t> AsInt() const;
  /// kBool only.
  std::optional<bool> AsBool() const;
  /// kStr (UTF-8).
  std::optional<std::string> AsStr() const;
  bool IsNone() const { return kind == Kind::kNone; }
};

struct Limits {
  size_t max_input_bytes = size_t{1} << 30;
  size_t max_values = size_t{1} << 24;  // values created (every push counts)
  uint32_t max_depth = 64;              // container nesting
  size_t max_memo = size_t{1} << 22;    // memo slots
  size_t max_stack = size_t{1} << 22;   // stack + mark stack entries
  // Memo references let a small pickle nest one container in another many times (a DAG whose
  // tree is exponential): the tree of every value, as Value::tree_values/tree_bytes count it,
  // is bounded too, so whatever walks the result (Dump, a converter) walks a bounded tree.
  size_t max_tree_values = size_t{1} << 24;
  size_t max_tree_bytes = size_t{1} << 30;  // str, bytes and global names
};

/// Decides whether a global may be referenced: (module, name) -> allowed.
using AllowGlobal = std::function<bool(std::string_view module, std::string_view name)>;

/// Parse one pickle (protocols 0-5 opcodes that carry data, no code). `source` names the input
/// in errors. Trailing bytes after STOP are refused.
ValuePtr Load(std::string_view bytes, const AllowGlobal& allow, std::string_view source,
              const Limits& limits = {});

// ---------------------------------------------------------------------------------------------
// Building values (for the writer and for tests)

ValuePtr None();
ValuePtr Bool(bool v);
ValuePtr Int(int64_t v);
ValuePtr Float(double v);
ValuePtr Str(std::string v);
ValuePtr Bytes(std::string v);
ValuePtr Tuple(std::vector<ValuePtr> items);
ValuePtr List(std::vector<ValuePtr> items);
ValuePtr Dict(std::vector<std::pair<ValuePtr, ValuePtr>> items);
ValuePtr Global(std::string module, std::string name);
/// callable(*args) via REDUCE, or cls.__new__(cls, *args) via NEWOBJ; `state` (may be null)
/// is applied with BUILD.
ValuePtr Object(ValuePtr callable, std::vector<ValuePtr> args, ValuePtr state = nullptr,
                bool newobj = false);
ValuePtr Persistent(ValuePtr id);

/// Serialise `value` as a protocol-2 pickle, or protocol 3 when it holds bytes (BINBYTES);
/// strings and globals are memoised, so repeated names cost a few bytes. InvalidArgumentError for a
/// value that cannot be written (a kDict with an odd item count, an object without a global
/// callable).
std::string Dump(const Value& value);

}  // namespace dcp::pickle
