// The pickle machine, restricted to building values (see pickle.h). Opcodes are those of
// CPython's Lib/pickle.py; the ones that exist only to run code (INST, OBJ, EXT*) or that no
// torch writer emits (text-mode protocol 0 forms, out-of-band buffers) are refused by name.
#include "dcp/storage/format/pickle.h"

#include <cstring>
#include <map>
#include <utility>

#include "dcp/proto/error.h"

namespace dcp::pickle {
namespace {

ValuePtr Make(Kind kind) {
  auto v = std::make_shared<Value>();
  v->kind = kind;
  return v;
}

const char* OpName(uint8_t op) {
  switch (op) {
    case 'I':
      return "INT (protocol 0)";
    case 'L':
      return "LONG (protocol 0)";
    case 'F':
      return "FLOAT (protocol 0)";
    case 'S':
      return "STRING (protocol 0)";
    case 'V':
      return "UNICODE (protocol 0)";
    case 'P':
      return "PERSID (protocol 0)";
    case 'g':
      return "GET (protocol 0)";
    case 'p':
      return "PUT (protocol 0)";
    case 'i':
      return "INST";
    case 'o':
      return "OBJ";
    case 0x82:
    case 0x83:
    case 0x84:
      return "EXT";
    case 0x8f:
      return "EMPTY_SET";
    case 0x90:
      return "ADDITEMS";
    case 0x91:
      return "FROZENSET";
    case 0x92:
      return "NEWOBJ_EX";
    case 0x96:
      return "BYTEARRAY8";
    case 0x97:
      return "NEXT_BUFFER";
    case 0x98:
      return "READONLY_BUFFER";
    default:
      return nullptr;
  }
}

class Machine {
 public:
  Machine(std::string_view in, const AllowGlobal& allow, std::string_view source,
          const Limits& limits)
      : in_(in), allow_(allow), source_(source), limits_(limits) {}

  ValuePtr Run() {
    if (in_.size() > limits_.max_input_bytes) {
      Corrupt("pickle of " + std::to_string(in_.size()) + " bytes exceeds the limit of " +
              std::to_string(limits_.max_input_bytes));
    }
    while (true) {
      if (pos_ >= in_.size()) Corrupt("pickle ends without STOP");
      op_pos_ = pos_;
      const uint8_t op = static_cast<uint8_t>(in_[pos_++]);
      if (op == '.') {  // STOP
        if (stack_.size() != 1 || !marks_.empty()) {
          Corrupt("STOP with " + std::to_string(stack_.size()) + " values on the stack");
        }
        if (pos_ != in_.size()) Corrupt("bytes after STOP");
        return stack_.back();
      }
      if (StackOrScalarOp(op) || ContainerOp(op) || ObjectOrMemoOp(op)) continue;
      const char* name = OpName(op);
      if (name) Unsupported(std::string("pickle opcode ") + name);
      Corrupt("unknown pickle opcode 0x" + Hex(op));
    }
  }

 private:
  // The opcodes of the stack, marks and scalars; false for any other.
  bool StackOrScalarOp(uint8_t op) {
    switch (op) {
      case 0x80: {  // PROTO
        const uint8_t proto = U8();
        if (proto > 5) Unsupported("pickle protocol " + std::to_string(proto));
        break;
      }
      case 0x95:
        Take(8);
        break;  // FRAME: a length hint only
      case '(':
        Mark();
        break;
      case '0':
        Pop();
        break;
      case '1':
        PopMark();
        break;
      case '2':
        Push(Top());
        break;
      case 'N':
        Push(Make(Kind::kNone));
        break;
      case 0x88:
        Push(BoolV(true));
        break;
      case 0x89:
        Push(BoolV(false));
        break;
      case 'J': {
        int32_t v;
        std::memcpy(&v, Take(4), 4);
        Push(IntV(v));
        break;
      }
      case 'K':
        Push(IntV(U8()));
        break;
      case 'M':
        Push(IntV(ULE(2)));
        break;
      case 0x8a:
        Push(IntV(Long(U8())));
        break;  // LONG1
      case 0x8b:
        Push(IntV(Long(ULE(4))));
        break;     // LONG4
      case 'G': {  // BINFLOAT (big-endian)
        const char* p = Take(8);
        uint64_t bits = 0;
        for (int i = 0; i < 8; ++i) bits = (bits << 8) | static_cast<uint8_t>(p[i]);
        double d;
        std::memcpy(&d, &bits, 8);
        auto v = Make(Kind::kFloat);
        v->real = d;
        Push(std::move(v));
        break;
      }
      case 0x8c:
        Push(StrV(Kind::kStr, U8()));
        break;  // SHORT_BINUNICODE
      case 'X':
        Push(StrV(Kind::kStr, ULE(4)));
        break;  // BINUNICODE
      case 0x8d:
        Push(StrV(Kind::kStr, ULE(8)));
        break;  // BINUNICODE8
      case 'C':
        Push(StrV(Kind::kBytes, U8()));
        break;  // SHORT_BINBYTES
      case 'B':
        Push(StrV(Kind::kBytes, ULE(4)));
        break;  // BINBYTES
      case 0x8e:
        Push(StrV(Kind::kBytes, ULE(8)));
        break;  // BINBYTES8
      case 'U':
        Push(StrV(Kind::kBytes, U8()));
        break;  // SHORT_BINSTRING (py2 str)
      case 'T':
        Push(StrV(Kind::kBytes, ULE(4)));
        break;  // BINSTRING
      default:
        return false;
    }
    return true;
  }
  // The opcodes that build tuples, lists and dicts; false for any other.
  bool ContainerOp(uint8_t op) {
    switch (op) {
      case ')':
        Push(Container(Kind::kTuple, {}));
        break;
      case 0x85:
        Push(Container(Kind::kTuple, PopN(1)));
        break;
      case 0x86:
        Push(Container(Kind::kTuple, PopN(2)));
        break;
      case 0x87:
        Push(Container(Kind::kTuple, PopN(3)));
        break;
      case 't':
        Push(Container(Kind::kTuple, PopMark()));
        break;
      case ']':
        Push(Container(Kind::kList, {}));
        break;
      case 'l':
        Push(Container(Kind::kList, PopMark()));
        break;
      case '}':
        Push(Container(Kind::kDict, {}));
        break;
      case 'd': {
        auto items = PopMark();
        if (items.size() % 2) Corrupt("DICT with an odd number of items");
        Push(Container(Kind::kDict, std::move(items)));
        break;
      }
      case 'a': {  // APPEND
        ValuePtr item = Pop();
        Extend(Top(), {std::move(item)}, Kind::kList);
        break;
      }
      case 'e': {  // APPENDS
        auto items = PopMark();
        Extend(Top(), std::move(items), Kind::kList);
        break;
      }
      case 's': {  // SETITEM
        ValuePtr value = Pop();
        ValuePtr key = Pop();
        Extend(Top(), {std::move(key), std::move(value)}, Kind::kDict);
        break;
      }
      case 'u': {  // SETITEMS
        auto items = PopMark();
        if (items.size() % 2) Corrupt("SETITEMS with an odd number of items");
        Extend(Top(), std::move(items), Kind::kDict);
        break;
      }
      default:
        return false;
    }
    return true;
  }
  // The opcodes of globals, objects, persistent ids and the memo; false for any other.
  bool ObjectOrMemoOp(uint8_t op) {
    switch (op) {
      case 'c': {  // GLOBAL module\nname\n
        std::string module = Line();
        std::string name = Line();
        Push(GlobalV(std::move(module), std::move(name)));
        break;
      }
      case 0x93: {  // STACK_GLOBAL
        ValuePtr name = Pop();
        ValuePtr module = Pop();
        if (module->kind != Kind::kStr || name->kind != Kind::kStr) {
          Corrupt("STACK_GLOBAL needs two strings");
        }
        Push(GlobalV(module->str, name->str));
        break;
      }
      case 'R':     // REDUCE
      case 0x81: {  // NEWOBJ
        ValuePtr args = Pop();
        ValuePtr callable = Pop();
        if (callable->kind != Kind::kGlobal) {
          Corrupt(std::string(op == 'R' ? "REDUCE" : "NEWOBJ") + " on a " + callable->Describe() +
                  ", not a global");
        }
        if (args->kind != Kind::kTuple) Corrupt("REDUCE/NEWOBJ arguments are not a tuple");
        auto v = Make(Kind::kObject);
        v->newobj = op == 0x81;
        Adopt(*v, args);
        Adopt(*v, callable);
        v->callable = std::move(callable);
        v->args = std::move(args);
        Push(std::move(v));
        break;
      }
      case 'b': {  // BUILD
        ValuePtr state = Pop();
        ValuePtr& obj = Top();
        if (obj->kind != Kind::kObject) Corrupt("BUILD on a " + obj->Describe());
        if (obj->state) Corrupt("BUILD applied twice to one object");
        if (obj->frozen) Unsupported("BUILD on an object already nested in another");
        if (state.get() == obj.get()) Unsupported("an object built from itself");
        Adopt(*obj, state);
        obj->state = std::move(state);
        break;
      }
      case 'Q': {  // BINPERSID
        ValuePtr id = Pop();
        auto v = Make(Kind::kPersistent);
        Adopt(*v, id);
        v->items.push_back(std::move(id));
        Push(std::move(v));
        break;
      }
      case 'q':
        Put(U8());
        break;  // BINPUT
      case 'r':
        Put(ULE(4));
        break;  // LONG_BINPUT
      case 0x94:
        Put(memo_.size());
        break;  // MEMOIZE
      case 'h':
        Get(U8());
        break;  // BINGET
      case 'j':
        Get(ULE(4));
        break;  // LONG_BINGET
      default:
        return false;
    }
    return true;
  }

  [[noreturn]] void Corrupt(const std::string& why) const {
    throw CorruptionError(std::string(source_) + ": invalid pickle at byte " +
                          std::to_string(op_pos_) + ": " + why);
  }
  [[noreturn]] void Unsupported(const std::string& why) const {
    throw UnsupportedError(std::string(source_) + ": pickle at byte " + std::to_string(op_pos_) +
                           " uses " + why + ", which is not accepted");
  }
  static std::string Hex(uint8_t b) {
    const char* d = "0123456789abcdef";
    return {d[b >> 4], d[b & 15]};
  }

  const char* Take(uint64_t n) {
    if (n > in_.size() - pos_) Corrupt("truncated (needs " + std::to_string(n) + " more bytes)");
    const char* p = in_.data() + pos_;
    pos_ += n;
    return p;
  }
  uint8_t U8() { return static_cast<uint8_t>(*Take(1)); }
  uint64_t ULE(int n) {
    const char* p = Take(n);
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
    return v;
  }
  // LONG1/LONG4: little-endian two's complement of n bytes; we take what fits in 64 bits.
  int64_t Long(uint64_t n) {
    if (n > 8) Unsupported("an integer wider than 64 bits");
    const char* p = Take(n);
    if (n == 0) return 0;
    uint64_t v = 0;
    for (int i = static_cast<int>(n) - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
    if (n < 8 && (static_cast<uint8_t>(p[n - 1]) & 0x80)) v |= ~uint64_t{0} << (8 * n);
    return static_cast<int64_t>(v);
  }
  std::string Line() {
    const size_t nl = in_.find('\n', pos_);
    if (nl == std::string_view::npos || nl - pos_ > 4096) Corrupt("GLOBAL without a name line");
    std::string s(in_.substr(pos_, nl - pos_));
    pos_ = nl + 1;
    return s;
  }

  void Count() {
    if (++values_ > limits_.max_values) {
      Corrupt("more than " + std::to_string(limits_.max_values) + " values");
    }
  }
  ValuePtr BoolV(bool b) {
    auto v = Make(Kind::kBool);
    v->boolean = b;
    return v;
  }
  ValuePtr IntV(int64_t i) {
    auto v = Make(Kind::kInt);
    v->integer = i;
    return v;
  }
  ValuePtr StrV(Kind kind, uint64_t n) {
    auto v = Make(kind);
    const char* p = Take(n);
    v->str.assign(p, n);
    v->tree_bytes = n;
    return v;
  }
  ValuePtr GlobalV(std::string module, std::string name) {
    if (!allow_ || !allow_(module, name)) {
      Unsupported("the global " + module + "." + name + " (not on the allow-list)");
    }
    auto v = Make(Kind::kGlobal);
    v->str = module + "\n" + name;
    v->tree_bytes = v->str.size();
    return v;
  }
  // Nest `child` in `parent`: the child may no longer change (so no structure can contain
  // itself), the parent's depth covers it and its tree holds the child's (once per reference).
  void Adopt(Value& parent, const ValuePtr& child) {
    child->frozen = true;
    if (child->depth + 1 > parent.depth) parent.depth = child->depth + 1;
    if (parent.depth > limits_.max_depth) {
      Corrupt("values nested deeper than " + std::to_string(limits_.max_depth));
    }
    if (__builtin_add_overflow(parent.tree_values, child->tree_values, &parent.tree_values) ||
        parent.tree_values > limits_.max_tree_values) {
      Corrupt("shared references (memo GETs) expand it to more than " +
              std::to_string(limits_.max_tree_values) + " values");
    }
    if (__builtin_add_overflow(parent.tree_bytes, child->tree_bytes, &parent.tree_bytes) ||
        parent.tree_bytes > limits_.max_tree_bytes) {
      Corrupt("shared references (memo GETs) expand it to more than " +
              std::to_string(limits_.max_tree_bytes) + " bytes of strings");
    }
  }
  ValuePtr Container(Kind kind, std::vector<ValuePtr> items) {
    auto v = Make(kind);
    for (auto& item : items) Adopt(*v, item);
    v->items = std::move(items);
    return v;
  }
  void Extend(const ValuePtr& target, std::vector<ValuePtr> items, Kind want) {
    // An OrderedDict is REDUCE(collections.OrderedDict, ()) followed by SETITEMS on the object
    // (torch.save(model.state_dict())): its pairs go to items, as a dict's do.
    const bool ordered_dict = want == Kind::kDict && target->kind == Kind::kObject &&
                              !target->newobj && target->args && target->args->items.empty() &&
                              target->global_name() == "collections.OrderedDict";
    if (target->kind != want && !ordered_dict) {
      Corrupt(std::string(want == Kind::kList ? "APPEND" : "SETITEM") + " on a " +
              target->Describe());
    }
    if (target->frozen) Unsupported("a container changed after being nested in another");
    for (auto& item : items) {
      if (item.get() == target.get()) Unsupported("a container that contains itself");
      Adopt(*target, item);
      target->items.push_back(std::move(item));
    }
  }

  void Push(ValuePtr v) {
    Count();
    if (stack_.size() + marks_.size() >= limits_.max_stack) Corrupt("stack too deep");
    stack_.push_back(std::move(v));
  }
  ValuePtr& Top() {
    if (stack_.size() <= Floor()) Corrupt("stack underflow");
    return stack_.back();
  }
  size_t Floor() const { return marks_.empty() ? 0 : marks_.back(); }
  ValuePtr Pop() {
    if (stack_.size() <= Floor()) Corrupt("stack underflow");
    ValuePtr v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  std::vector<ValuePtr> PopN(size_t n) {
    if (stack_.size() < Floor() + n) Corrupt("stack underflow");
    std::vector<ValuePtr> items(std::make_move_iterator(stack_.end() - n),
                                std::make_move_iterator(stack_.end()));
    stack_.resize(stack_.size() - n);
    return items;
  }
  void Mark() {
    if (stack_.size() + marks_.size() >= limits_.max_stack) Corrupt("stack too deep");
    marks_.push_back(stack_.size());
  }
  std::vector<ValuePtr> PopMark() {
    if (marks_.empty()) Corrupt("no MARK on the stack");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<ValuePtr> items(std::make_move_iterator(stack_.begin() + m),
                                std::make_move_iterator(stack_.end()));
    stack_.resize(m);
    return items;
  }
  void Put(uint64_t index) {
    if (index >= limits_.max_memo) {
      Corrupt("memo index " + std::to_string(index) + " beyond the limit");
    }
    if (index >= memo_.size()) memo_.resize(index + 1);
    memo_[index] = Top();
  }
  void Get(uint64_t index) {
    if (index >= memo_.size() || !memo_[index]) {
      Corrupt("memo index " + std::to_string(index) + " was never stored");
    }
    Push(memo_[index]);
  }

  std::string_view in_;
  const AllowGlobal& allow_;
  std::string_view source_;
  Limits limits_;
  size_t pos_ = 0, op_pos_ = 0, values_ = 0;
  std::vector<ValuePtr> stack_;
  std::vector<size_t> marks_;
  std::vector<ValuePtr> memo_;
};

// ---------------------------------------------------------------------------------------------

class Writer {
 public:
  std::string Finish(const Value& v) {
    // Protocol 2, as torch.save writes (torch 2.x's weights_only loader warns on others);
    // protocol 3 only when a bytes value needs BINBYTES.
    out_ += '\x80';
    out_ += '\x02';
    Emit(v);
    out_ += '.';
    if (wrote_bytes_) out_[1] = '\x03';
    return std::move(out_);
  }

 private:
  void LE(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xff);
  }
  bool Memo(const std::string& key) {  // emit a BINGET if `key` was memoised
    auto it = memo_.find(key);
    if (it == memo_.end()) return false;
    if (it->second < 256) {
      out_ += 'h';
      LE(it->second, 1);
    } else {
      out_ += 'j';
      LE(it->second, 4);
    }
    return true;
  }
  void Remember(const std::string& key) {
    const size_t idx = memo_.size();
    memo_.emplace(key, idx);
    if (idx < 256) {
      out_ += 'q';
      LE(idx, 1);
    } else {
      out_ += 'r';
      LE(idx, 4);
    }
  }
  void Emit(const Value& v) {
    switch (v.kind) {
      case Kind::kNone:
        out_ += 'N';
        return;
      case Kind::kBool:
        out_ += v.boolean ? '\x88' : '\x89';
        return;
      case Kind::kInt:
        if (v.integer >= 0 && v.integer < 256) {
          out_ += 'K';
          LE(v.integer, 1);
        } else if (v.integer >= 0 && v.integer < 65536) {
          out_ += 'M';
          LE(v.integer, 2);
        } else if (v.integer >= INT32_MIN && v.integer <= INT32_MAX) {
          out_ += 'J';
          LE(static_cast<uint32_t>(static_cast<int32_t>(v.integer)), 4);
        } else {
          out_ += '\x8a';
          LE(8, 1);
          LE(static_cast<uint64_t>(v.integer), 8);
        }
        return;
      case Kind::kFloat: {
        uint64_t bits;
        std::memcpy(&bits, &v.real, 8);
        out_ += 'G';
        for (int i = 7; i >= 0; --i) out_ += static_cast<char>((bits >> (8 * i)) & 0xff);
        return;
      }
      case Kind::kStr: {
        const std::string key = "s" + v.str;
        if (Memo(key)) return;
        out_ += 'X';
        LE(v.str.size(), 4);
        out_ += v.str;
        Remember(key);
        return;
      }
      case Kind::kBytes:
        wrote_bytes_ = true;
        if (v.str.size() < 256) {
          out_ += 'C';
          LE(v.str.size(), 1);
        } else {
          if (v.str.size() > UINT32_MAX) throw InvalidArgumentError("pickle: bytes over 4 GiB");
          out_ += 'B';
          LE(v.str.size(), 4);
        }
        out_ += v.str;
        return;
      case Kind::kTuple:
        if (v.items.size() <= 3) {
          for (const auto& item : v.items) Emit(*item);
          static const char kOps[] = {')', '\x85', '\x86', '\x87'};
          out_ += kOps[v.items.size()];
        } else {
          out_ += '(';
          for (const auto& item : v.items) Emit(*item);
          out_ += 't';
        }
        return;
      case Kind::kList:
        out_ += ']';
        if (!v.items.empty()) {
          out_ += '(';
          for (const auto& item : v.items) Emit(*item);
          out_ += 'e';
        }
        return;
      case Kind::kDict:
        if (v.items.size() % 2) throw InvalidArgumentError("pickle: dict with an odd item count");
        out_ += '}';
        if (!v.items.empty()) {
          out_ += '(';
          for (const auto& item : v.items) Emit(*item);
          out_ += 'u';
        }
        return;
      case Kind::kGlobal: {
        const std::string key = "g" + v.str;
        if (Memo(key)) return;
        out_ += 'c';
        out_ += v.module();
        out_ += '\n';
        out_ += v.name();
        out_ += '\n';
        Remember(key);
        return;
      }
      case Kind::kObject:
        if (!v.callable || v.callable->kind != Kind::kGlobal || !v.args ||
            v.args->kind != Kind::kTuple) {
          throw InvalidArgumentError("pickle: an object needs a global and an argument tuple");
        }
        Emit(*v.callable);
        Emit(*v.args);
        out_ += v.newobj ? '\x81' : 'R';
        if (!v.items.empty()) {  // an OrderedDict's pairs
          if (v.items.size() % 2) throw InvalidArgumentError("pickle: dict with an odd item count");
          out_ += '(';
          for (const auto& item : v.items) Emit(*item);
          out_ += 'u';
        }
        if (v.state) {
          Emit(*v.state);
          out_ += 'b';
        }
        return;
      case Kind::kPersistent:
        if (v.items.size() != 1) throw InvalidArgumentError("pickle: persistent id needs one id");
        Emit(*v.items[0]);
        out_ += 'Q';
        return;
    }
  }

  std::string out_;
  bool wrote_bytes_ = false;
  std::map<std::string, size_t> memo_;
};

}  // namespace

std::string Value::global_name() const {
  const Value* g = kind == Kind::kObject ? callable.get() : this;
  if (!g || g->kind != Kind::kGlobal) return {};
  return g->module() + "." + g->name();
}

std::optional<double> Value::AsFloat() const {
  if (kind == Kind::kFloat) return real;
  if (kind == Kind::kInt) return static_cast<double>(integer);
  return std::nullopt;
}

std::optional<int64_t> Value::AsInt() const {
  if (kind == Kind::kInt) return integer;
  return std::nullopt;
}

std::optional<bool> Value::AsBool() const {
  if (kind == Kind::kBool) return boolean;
  return std::nullopt;
}

std::optional<std::string> Value::AsStr() const {
  if (kind == Kind::kStr) return str;
  return std::nullopt;
}

const Value* Value::Get(std::string_view key) const {
  if (kind != Kind::kDict) return nullptr;
  for (size_t i = 0; i + 1 < items.size(); i += 2) {
    if (items[i]->kind == Kind::kStr && items[i]->str == key) return items[i + 1].get();
  }
  return nullptr;
}

std::string Value::Describe() const {
  switch (kind) {
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kStr:
      return "str";
    case Kind::kBytes:
      return "bytes";
    case Kind::kTuple:
      return "tuple of " + std::to_string(items.size());
    case Kind::kList:
      return "list of " + std::to_string(items.size());
    case Kind::kDict:
      return "dict";
    case Kind::kGlobal:
      return "global " + global_name();
    case Kind::kObject:
      return global_name() + "(...)";
    case Kind::kPersistent:
      return "persistent id";
  }
  return "value";
}

ValuePtr Load(std::string_view bytes, const AllowGlobal& allow, std::string_view source,
              const Limits& limits) {
  return Machine(bytes, allow, source, limits).Run();
}

ValuePtr None() { return Make(Kind::kNone); }
ValuePtr Bool(bool v) {
  auto p = Make(Kind::kBool);
  p->boolean = v;
  return p;
}
ValuePtr Int(int64_t v) {
  auto p = Make(Kind::kInt);
  p->integer = v;
  return p;
}
ValuePtr Float(double v) {
  auto p = Make(Kind::kFloat);
  p->real = v;
  return p;
}
ValuePtr Str(std::string v) {
  auto p = Make(Kind::kStr);
  p->str = std::move(v);
  return p;
}
ValuePtr Bytes(std::string v) {
  auto p = Make(Kind::kBytes);
  p->str = std::move(v);
  return p;
}
ValuePtr Tuple(std::vector<ValuePtr> items) {
  auto p = Make(Kind::kTuple);
  p->items = std::move(items);
  return p;
}
ValuePtr List(std::vector<ValuePtr> items) {
  auto p = Make(Kind::kList);
  p->items = std::move(items);
  return p;
}
ValuePtr Dict(std::vector<std::pair<ValuePtr, ValuePtr>> items) {
  auto p = Make(Kind::kDict);
  for (auto& [k, v] : items) {
    p->items.push_back(std::move(k));
    p->items.push_back(std::move(v));
  }
  return p;
}
ValuePtr Global(std::string module, std::string name) {
  auto p = Make(Kind::kGlobal);
  p->str = std::move(module) + "\n" + std::move(name);
  return p;
}
ValuePtr Object(ValuePtr callable, std::vector<ValuePtr> args, ValuePtr state, bool newobj) {
  auto p = Make(Kind::kObject);
  p->callable = std::move(callable);
  p->args = Tuple(std::move(args));
  p->state = std::move(state);
  p->newobj = newobj;
  return p;
}
ValuePtr Persistent(ValuePtr id) {
  auto p = Make(Kind::kPersistent);
  p->items.push_back(std::move(id));
  return p;
}

std::string Dump(const Value& value) { return Writer().Finish(value); }

}  // namespace dcp::pickle
