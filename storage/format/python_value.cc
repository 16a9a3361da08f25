// A blob's Python value: the restricted unpickler's tree (torch_dcp.h) copied into the public
// PyValue, so no caller needs the unpickler's types. Shared sub-values (memo references) stay
// shared, so the copy costs what the pickle's own values cost, never its expanded tree.
#include <unordered_map>

#include "dcp/proto/error.h"
#include "dcp/storage/format/layout.h"
#include "dcp/storage/format/torch_dcp.h"

namespace dcp {
namespace {

class PlainCopier {
 public:
  explicit PlainCopier(const std::string& what) : what_(what) {}

  PyValuePtr Copy(const pickle::Value& v) {
    if (auto it = done_.find(&v); it != done_.end()) return it->second;
    auto out = std::make_shared<PyValue>();
    out->kind = KindOf(v);
    out->boolean = v.boolean;
    out->integer = v.integer;
    out->real = v.real;
    out->str = v.str;
    out->items.reserve(v.items.size());
    for (const pickle::ValuePtr& item : v.items) out->items.push_back(Copy(*item));
    PyValuePtr frozen = std::move(out);
    done_.emplace(&v, frozen);
    return frozen;
  }

 private:
  PyValue::Kind KindOf(const pickle::Value& v) const {
    using K = pickle::Kind;
    switch (v.kind) {
      case K::kNone: return PyValue::Kind::kNone;
      case K::kBool: return PyValue::Kind::kBool;
      case K::kInt: return PyValue::Kind::kInt;
      case K::kFloat: return PyValue::Kind::kFloat;
      case K::kStr: return PyValue::Kind::kStr;
      case K::kBytes: return PyValue::Kind::kBytes;
      case K::kTuple: return PyValue::Kind::kTuple;
      case K::kList: return PyValue::Kind::kList;
      case K::kDict: return PyValue::Kind::kDict;
      default:
        // TorchSaveObject admits plain values only; anything else is a reader bug.
        throw InternalError(what_ + ": the unpickler returned a " + v.Describe() +
                            " where a plain value was expected");
    }
  }

  const std::string& what_;
  std::unordered_map<const pickle::Value*, PyValuePtr> done_;
};

}  // namespace

PyValuePtr ReadPythonValue(std::string_view bytes, const std::string& what) {
  const pickle::ValuePtr value = TorchSaveObject(bytes, what);
  return PlainCopier(what).Copy(*value);
}

}  // namespace dcp
