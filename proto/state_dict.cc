#include "dcp/proto/state_dict.h"

#include <atomic>

#include "dcp/proto/error.h"

namespace dcp {

StateDict& StateDict::Set(const std::string& key, StateValue value) {
  items_[key] = std::move(value);
  return *this;
}

StateDict& StateDict::Nested(const std::string& key) {
  auto it = items_.find(key);
  if (it == items_.end()) {
    auto child = std::make_shared<StateDict>();
    StateDict& ref = *child;
    items_.emplace(key, std::move(child));
    return ref;
  }
  auto* nested = std::get_if<std::shared_ptr<StateDict>>(&it->second);
  if (nested == nullptr || *nested == nullptr) {
    throw InvalidArgumentError("state dict key '" + key + "' holds a leaf, not a nested dict");
  }
  return **nested;
}

StateValue* StateDict::Find(const std::string& key) {
  auto it = items_.find(key);
  return it == items_.end() ? nullptr : &it->second;
}

const StateValue* StateDict::Find(const std::string& key) const {
  auto it = items_.find(key);
  return it == items_.end() ? nullptr : &it->second;
}

namespace {

// Marks a resolved copy: Save/Load must not resolve it again.
class ResolvedMark : public ViewBinding {
 public:
  explicit ResolvedMark(std::shared_ptr<const ViewBinding> from) : from(std::move(from)) {}
  TensorView Resolve() const override { return from->Resolve(); }
  std::shared_ptr<const ViewBinding> from;
};

bool Bound(const TensorView& v) {
  return v.binding && !dynamic_cast<const ResolvedMark*>(v.binding.get());
}

TensorView ResolveView(const TensorView& v) {
  if (!Bound(v)) return v;
  TensorView r = v.binding->Resolve();
  r.binding = std::make_shared<ResolvedMark>(v.binding);
  return r;
}

// A resolved blob: its bytes came from `from`, which gets what a load reads.
class ResolvedBlobMark : public BlobBinding {
 public:
  explicit ResolvedBlobMark(std::shared_ptr<const BlobBinding> from) : from(std::move(from)) {}
  std::string Bytes() const override { return from->Bytes(); }
  std::shared_ptr<const BlobBinding> from;
};

bool Bound(const Blob& b) {
  return b.binding && !dynamic_cast<const ResolvedBlobMark*>(b.binding.get());
}

void LoadedView(const TensorView& v) {
  if (const auto* mark = dynamic_cast<const ResolvedMark*>(v.binding.get())) {
    mark->from->Loaded(v);
  }
}

}  // namespace

void BlobBinding::Loaded(const std::string&) const {}

bool HasBindings(const StateDict& sd) {
  for (const auto& [key, value] : sd.items()) {
    if (const auto* t = std::get_if<TensorView>(&value)) {
      if (Bound(*t)) return true;
    } else if (const auto* b = std::get_if<Blob>(&value)) {
      if (Bound(*b)) return true;
    } else if (const auto* st = std::get_if<ShardedTensor>(&value)) {
      for (const auto& shard : st->local_shards) {
        if (Bound(shard.view)) return true;
      }
    } else if (const auto* nested = std::get_if<std::shared_ptr<StateDict>>(&value)) {
      if (*nested && HasBindings(**nested)) return true;
    }
  }
  return false;
}

namespace {
std::atomic<uint64_t> resolve_epoch{1};
thread_local uint64_t current_epoch = 0;
thread_local int resolve_depth = 0;
}  // namespace

uint64_t ResolveEpoch() { return resolve_depth > 0 ? current_epoch : resolve_epoch.fetch_add(1); }

StateDict ResolveBindings(const StateDict& sd) {
  // One epoch for the whole (recursive) resolution on this thread.
  if (resolve_depth++ == 0) current_epoch = resolve_epoch.fetch_add(1);
  struct Leave {
    ~Leave() { --resolve_depth; }
  } leave;
  StateDict out;
  for (const auto& [key, value] : sd.items()) {
    if (const auto* t = std::get_if<TensorView>(&value)) {
      out.Set(key, ResolveView(*t));
    } else if (const auto* st = std::get_if<ShardedTensor>(&value)) {
      ShardedTensor copy = *st;
      for (auto& shard : copy.local_shards) shard.view = ResolveView(shard.view);
      out.Set(key, std::move(copy));
    } else if (const auto* nested = std::get_if<std::shared_ptr<StateDict>>(&value)) {
      out.Set(key, *nested ? std::make_shared<StateDict>(ResolveBindings(**nested)) : nullptr);
    } else if (const auto* b = std::get_if<Blob>(&value); b && Bound(*b)) {
      out.Set(key, Blob{b->binding->Bytes(), std::make_shared<ResolvedBlobMark>(b->binding)});
    } else {
      out.Set(key, value);
    }
  }
  return out;
}

void FinishBoundLoad(StateDict& original, const StateDict& resolved) {
  for (const auto& [key, value] : resolved.items()) {
    StateValue* orig = original.Find(key);
    if (const auto* t = std::get_if<TensorView>(&value)) {
      LoadedView(*t);
    } else if (const auto* st = std::get_if<ShardedTensor>(&value)) {
      for (const auto& shard : st->local_shards) LoadedView(shard.view);
    } else if (const auto* nested = std::get_if<std::shared_ptr<StateDict>>(&value)) {
      auto* orig_nested = orig ? std::get_if<std::shared_ptr<StateDict>>(orig) : nullptr;
      if (*nested && orig_nested && *orig_nested) FinishBoundLoad(**orig_nested, **nested);
    } else if (const auto* blob = std::get_if<Blob>(&value)) {
      const auto* mark = dynamic_cast<const ResolvedBlobMark*>(blob->binding.get());
      if (mark) mark->from->Loaded(blob->bytes);
      if (auto* o = orig ? std::get_if<Blob>(orig) : nullptr) {
        o->bytes = blob->bytes;
        if (!mark) o->binding = blob->binding;
      }
    }
  }
}

std::optional<double> PyValue::AsFloat() const {
  if (kind == Kind::kFloat) return real;
  if (kind == Kind::kInt) return static_cast<double>(integer);
  return std::nullopt;
}

std::optional<int64_t> PyValue::AsInt() const {
  if (kind == Kind::kInt) return integer;
  return std::nullopt;
}

std::optional<bool> PyValue::AsBool() const {
  if (kind == Kind::kBool) return boolean;
  return std::nullopt;
}

std::optional<std::string> PyValue::AsStr() const {
  if (kind == Kind::kStr) return str;
  return std::nullopt;
}

const PyValue* PyValue::Get(std::string_view key) const {
  if (kind != Kind::kDict) return nullptr;
  for (size_t i = 0; i + 1 < items.size(); i += 2) {
    if (items[i]->kind == Kind::kStr && items[i]->str == key) return items[i + 1].get();
  }
  return nullptr;
}

}  // namespace dcp
