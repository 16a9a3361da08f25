// Flattening of nested state dicts into dotted fully-qualified names ("model.layer1.weight").
#pragma once

#include <map>
#include <string>

#include "dcp/proto/plan.h"
#include "dcp/proto/state_dict.h"

namespace dcp {

template <typename ValuePtr>
struct FlatEntryT {
  KeyPath path;    // keys from the root, e.g. {"model", "layer1", "weight"}
  ValuePtr value;  // points into the state dict; valid while the dict is not modified
};
using FlatEntry = FlatEntryT<const StateValue*>;
using MutableFlatEntry = FlatEntryT<StateValue*>;

/// Flatten `sd` by joining nested keys with '.'. Nested dicts that are empty vanish.
/// Throws InvalidArgumentError naming the FQN when two paths flatten to the same name
/// (e.g. {"a": {"b": x}} and {"a.b": y}), or when a key is empty or a nested pointer is null.
std::map<std::string, FlatEntry> FlattenStateDict(const StateDict& sd);
std::map<std::string, MutableFlatEntry> FlattenStateDict(StateDict& sd);

/// Rebuild a nested StateDict from flat entries and their key paths (inverse of flattening).
void InsertAtPath(StateDict& root, const KeyPath& path, StateValue value);

}  // namespace dcp
