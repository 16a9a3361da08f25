#!/usr/bin/env python3
"""Every field of every public options struct has a test that fails when the field is ignored.

The structs are those of dcp/options.h and StorageOptions (dcp/storage/storage.h). A test claims
a field with the Catch2 tag [option:Struct::field]; this check lists every field no test claims
(and every claim naming a field that does not exist), so a new option cannot land untested.
Usage: options_coverage_check.py SOURCE_DIR
"""
import pathlib
import re
import sys

STRUCTS = {
    "dcp/options.h": ["SaveOptions", "LoadOptions", "AsyncOptions", "ManagerOptions",
                      "MemoryTierOptions", "PreemptionOptions"],
    "storage/storage.h": ["StorageOptions"],
}


def fields_of(text, struct):
    m = re.search(r"struct " + struct + r" \{(.*?)\n\};", text, re.S)
    if not m:
        raise SystemExit(f"options_coverage_check: struct {struct} not found")
    body = re.sub(r"//[^\n]*", "", m.group(1))
    out = []
    for decl in body.split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        head = re.sub(r"\{.*\}$", "", decl.split("=")[0].strip()).strip()
        if re.search(r"\)\s*(const)?\s*(noexcept)?$", head):
            continue  # a member function, not a field
        name = head
        out.append(re.split(r"[\s*&]", name)[-1])
    return out


def main():
    root = pathlib.Path(sys.argv[1])
    fields = set()
    for header, structs in STRUCTS.items():
        text = (root / header).read_text()
        for s in structs:
            fields.update(f"{s}::{f}" for f in fields_of(text, s))
    claimed = set()
    for path in (root / "tests").rglob("*.cc"):
        claimed.update(re.findall(r"\[option:(\w+::\w+)\]", path.read_text()))
    missing = sorted(fields - claimed)
    unknown = sorted(claimed - fields)
    for f in missing:
        print(f"no test claims {f} (tag a test that fails when it is ignored: [option:{f}])")
    for f in unknown:
        print(f"a test claims [option:{f}], which is not a field of a public options struct")
    print(f"{len(fields) - len(missing)}/{len(fields)} option fields have a test")
    return 1 if missing or unknown else 0


if __name__ == "__main__":
    sys.exit(main())
