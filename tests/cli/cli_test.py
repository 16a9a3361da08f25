#!/usr/bin/env python3
"""Tests of the `dcp` command line on checkpoints made by dcp_cli_fixture.

    cli_test.py PART --dcp BIN --fixture BIN --plugin LIB --workdir DIR

PART is basic (inspect, verify, diff, error exit codes; standard library only), safetensors
(an independent reader with numpy), torch (torch.load of the converted file) or plugin (the kv://
backend through --plugin). Exits 77 (skipped) when numpy, torch or the plugin are unavailable.
"""
import argparse
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import time
import zlib

SKIP = 77
args = None


def run(*cmd, expect=None):
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    out = p.stdout + p.stderr
    if expect is not None and p.returncode != expect:
        sys.exit(f"FAIL: {' '.join(map(str, cmd))}: exit {p.returncode}, expected {expect}\n{out}")
    return p.returncode, out


def dcp(*a, expect=0):
    return run(args.dcp, *a, expect=expect)


def check(cond, msg):
    if not cond:
        sys.exit("FAIL: " + msg)


def contains(out, *needles):
    for n in needles:
        check(n in out, f"expected {n!r} in:\n{out}")


def fresh(name, changed=False, zstd=False, extra=()):
    path = os.path.join(args.workdir, name)
    shutil.rmtree(path, ignore_errors=True)
    run(args.fixture, path, *(["--changed"] if changed else []), *(["--zstd"] if zstd else []),
        *extra, expect=0)
    return path


def test_incremental():
    """Format version 3 (issue 46): inspect shows what a checkpoint shares and with which
    checkpoint, verify names a missing shared file, convert writes a self-contained copy."""
    a = fresh("inc_a", extra=["--hashes"])
    b = fresh("inc_b", changed=True, extra=["--base", "inc_a"])
    _, out = dcp("inspect", b)
    contains(out, "format version 3", "in the files of the earlier checkpoint inc_a")
    j = inspect_json(b)
    check(j["format_version"] == 3, f"format_version {j['format_version']}")
    check(len(j["shared"]) == 1 and j["shared"][0]["checkpoint"] == "inc_a"
          and j["shared"][0]["items"] > 0, f"shared: {j['shared']}")
    files = {c["file"] for e in j["entries"] for c in e["chunks"]}
    check(any(f.startswith("../inc_a/data-") for f in files), f"files: {files}")
    check(all(len(c.get("xxh3_128", "")) == 32 for e in j["entries"] for c in e["chunks"]),
          "every item has its xxh3_128")
    dcp("verify", b)
    # The values are the changed fixture's, shared items included.
    conv = os.path.join(args.workdir, "inc_conv")
    shutil.rmtree(conv, ignore_errors=True)
    dcp("convert", b, conv)
    jc = inspect_json(conv)
    check(jc["shared"] == [] and jc["format_version"] == 2, "convert writes a self-contained copy")
    _, diff = dcp("diff", b, conv, "--values")
    # A shared file removed by hand: verify names it (and the checkpoint it belongs to).
    for name in os.listdir(a):
        if name.startswith("data-"):
            os.remove(os.path.join(a, name))
    code, out = run(args.dcp, "verify", b)
    check(code != 0, "verify fails once a shared file is gone")
    contains(out, "../inc_a/data-")


def inspect_json(path, *extra):
    _, out = dcp("inspect", path, "--json", *extra)
    return json.loads(out)


def w_chunk(path):
    """Where the stored chunk [3, 0] of model.w lives in checkpoint `path`."""
    by = {e["fqn"]: e for e in inspect_json(path)["entries"]}
    return next(c for c in by["model.w"]["chunks"] if c["offsets"] == [3, 0])


# Expected values, computed independently of dcp (see make_checkpoint.cc).
def expected():
    import numpy as np
    w = np.array([[i * 10 + j + 0.25 for j in range(5)] for i in range(6)], dtype=np.float32)
    c = np.array([[(i - j) * 0.5 for j in range(6)] for i in range(4)], dtype=np.float32)
    h = (np.arange(12, dtype=np.float32) / 8).reshape(3, 4).astype(np.float16)
    bf = np.arange(5, dtype=np.float32) - 2.5
    return {
        "model.w": w, "model.c": c, "model.h": h, "model.bf": bf,
        "step": np.array(1234567890123, dtype=np.int64),
        "mask": np.array([i % 2 == 0 for i in range(7)], dtype=np.bool_),
        "i8": (np.arange(6) - 3).astype(np.int8).reshape(2, 3),
        "model.k": np.array([[[i * 100 + j * 10 + l for l in range(4)] for j in range(3)]
                             for i in range(2)], dtype=np.float64),
    }


def test_basic():
    a = fresh("a")
    b = fresh("b", changed=True)
    _, out = dcp("inspect", a)
    contains(out, "world size      2", "model.w", "float32", "[6, 5]", "bfloat16", "rng", "bytes",
             "8 tensors, 1 blobs", "in 2 files")
    doc = inspect_json(a)
    check(doc["world_size"] == 2 and doc["tensors"] == 8 and doc["blobs"] == 1, str(doc))
    check(doc["format_version"] == 2 and doc["files"] == 2, str(doc))
    by = {e["fqn"]: e for e in doc["entries"]}
    check(by["model.c"]["shape"] == [4, 6] and len(by["model.c"]["chunks"]) == 2, str(by["model.c"]))
    check(by["rng"]["kind"] == "bytes" and by["rng"]["bytes"] == 8, str(by["rng"]))
    filtered = inspect_json(a, "--filter", "model.*")
    check(sorted(e["fqn"] for e in filtered["entries"]) == ["model.bf", "model.c", "model.h", "model.k", "model.w"],
          str(filtered["entries"]))
    _, out = dcp("inspect", a, "--filter", "model.w")
    check("model.c" not in out and "model.w" in out, out)

    _, out = dcp("verify", a)
    contains(out, "OK:", "12 stored items")
    check("\r" not in out, "progress bar drawn although stderr is not a terminal")

    # diff: metadata equal; values differ in model.w only. Without --values the stored checksums
    # stand in for the values (it said "no differences" here).
    _, out = dcp("diff", a, b, expect=1)
    contains(out, "values differ: model.w: 1 of ", "chunks by stored checksum", "1 difference(s)")
    check("model.c" not in out, out)
    _, out = dcp("diff", a, a)
    contains(out, "no differences (", "compared by stored checksum")
    _, out = dcp("--version")
    check(out.startswith("dcp ") and out.strip()[4:5].isdigit(), out)
    _, out = dcp("diff", a, b, "--values", expect=1)
    contains(out, "values differ: model.w: 1 of 30 elements, max abs diff 0.5", "1 difference(s)")
    _, out = dcp("diff", a, a, "--values")
    contains(out, "no differences", "9 compared by value")
    _, out = dcp("diff", a, b, "--values", "--atol", "0.6")
    contains(out, "no differences")

    # convert --metadata-version rewrites between the metadata versions; the values stay.
    for version in ("1", "2"):
        out_dir = os.path.join(args.workdir, "basic_v" + version)
        shutil.rmtree(out_dir, ignore_errors=True)
        dcp("convert", a, out_dir, "--metadata-version", version)
        check(inspect_json(out_dir)["format_version"] == int(version), version)
        _, out = dcp("diff", a, out_dir, "--values")
        contains(out, "no differences")
        _, out = dcp("verify", out_dir)
        contains(out, "OK")

    test_plain_path_query(a)

    # Damage: a flipped byte, a truncated file, a missing file.
    d = fresh("flip")
    w0 = w_chunk(d)
    path = os.path.join(d, w0["file"])
    data = bytearray(open(path, "rb").read())
    data[w0["offset"] + 7] ^= 0x01
    open(path, "wb").write(data)
    _, out = dcp("verify", d, expect=1)
    contains(out, "checksum mismatch: 'model.w' chunk [3, 0]", f"'{w0['file']}'",
             f"at offset {w0['offset']}", "FAILED")
    _, out = dcp("diff", d, a, "--values", expect=1)  # value reads check checksums too
    contains(out, "checksum mismatch", "model.w")

    d = fresh("trunc")
    w0 = w_chunk(d)
    path = os.path.join(d, w0["file"])
    size = os.path.getsize(path)
    os.truncate(path, w0["offset"] + 4)
    _, out = dcp("verify", d, expect=1)
    # Version 2: the file's index (at its end) went with the truncation: its items are reported
    # as lying past the file's end.
    contains(out, f"truncated file '{w0['file']}'", "'model.w' chunk [3, 0] needs bytes", "FAILED")
    check(size > w0["offset"] + 4, "truncation did not shorten the file")

    d = fresh("missing")
    w0 = w_chunk(d)
    os.remove(os.path.join(d, w0["file"]))
    _, out = dcp("verify", d, expect=1)
    contains(out, f"missing file '{w0['file']}'", "'model.w' chunk [3, 0]", "FAILED")

    # An unreferenced data file is reported but does not fail the check.
    d = fresh("extra")
    w0 = w_chunk(d)
    shutil.copy(os.path.join(d, w0["file"]), os.path.join(d, "data-0123456789abcdef-r0-b0.data"))
    _, out = dcp("verify", d)
    contains(out, "warning: unreferenced data file 'data-0123456789abcdef-r0-b0.data'", "OK:")

    # Compressed items (the fixture's --zstd: every item that shrinks; the rest stay raw).
    z = fresh("z", zstd=True)
    chunks = [(e["fqn"], c) for e in inspect_json(z)["entries"] for c in e["chunks"]]
    zstd = [(f, c) for f, c in chunks if c["transforms"] == ["zstd"]]
    check(zstd and len(zstd) < len(chunks), f"expected a mix of zstd and raw items: {chunks}")
    for f, c in zstd:
        check(c["length"] < c["raw_length"], f"{f}: {c}")
    _, out = dcp("inspect", z)
    contains(out, "TRANSFORM", "zstd", "raw")
    _, out = dcp("verify", z)
    contains(out, "OK:", "12 stored items")
    _, out = dcp("diff", a, z, "--values")  # decompressed values equal the raw checkpoint's
    contains(out, "no differences", "9 compared by value")
    _, out = dcp("diff", b, z, "--values", expect=1)
    contains(out, "values differ: model.w: 1 of 30 elements")
    d = fresh("zflip", zstd=True)
    f, c = next((e["fqn"], c) for e in inspect_json(d)["entries"] for c in e["chunks"]
                if c["transforms"] == ["zstd"])
    path = os.path.join(d, c["file"])
    data = bytearray(open(path, "rb").read())
    data[c["offset"] + c["length"] // 2] ^= 0x01
    open(path, "wb").write(data)
    _, out = dcp("verify", d, expect=1)  # the CRC32C covers the compressed bytes
    contains(out, "checksum mismatch: '" + f + "'", f"at offset {c['offset']}", "FAILED")
    _, out = dcp("diff", d, a, "--values", expect=1)
    contains(out, "damaged data", f, c["file"])

    # Clear errors with distinct exit codes.
    empty = os.path.join(args.workdir, "empty")
    os.makedirs(empty, exist_ok=True)
    _, out = dcp("inspect", empty, expect=3)
    contains(out, "not a checkpoint")
    d = fresh("incomplete")
    os.remove(os.path.join(d, "metadata.dcp"))
    _, out = dcp("verify", d, expect=4)
    contains(out, "incomplete checkpoint")
    d = fresh("garbage")
    open(os.path.join(d, "metadata.dcp"), "wb").write(b"hello, not a checkpoint")
    _, out = dcp("inspect", d, expect=3)
    contains(out, "not a dcp metadata file")
    d = fresh("corrupt")
    md = bytearray(open(os.path.join(d, "metadata.dcp"), "rb").read())
    md[len(md) // 2] ^= 0x40
    open(os.path.join(d, "metadata.dcp"), "wb").write(md)
    _, out = dcp("verify", d, expect=5)
    contains(out, "corrupt metadata", "checksum")
    d = fresh("future")
    md = bytearray(open(os.path.join(d, "metadata.dcp"), "rb").read())
    md[8:12] = struct.pack("<I", 99)
    open(os.path.join(d, "metadata.dcp"), "wb").write(md)
    _, out = dcp("inspect", d, expect=6)
    contains(out, "version 99")
    _, out = dcp("inspect", "nosuch://x", expect=2)
    contains(out, "--plugin")
    _, out = dcp("--help")
    contains(out, "Exit codes", "incomplete checkpoint")
    dcp("frobnicate", expect=2)

    test_json(a, b)
    test_flag_hints(a)
    test_hostile(a)
    test_hostile_safetensors()
    test_hostile_torch_save()


def test_plain_path_query(a):
    """A query on a plain path means what it means on file:// (issue 43). Before, `convert A
    DIR?format=safetensors` wrote a dcp checkpoint into a directory literally named
    'DIR?format=safetensors' and exited 0."""
    hf = os.path.join(args.workdir, "basic_hf")
    for p in (hf, hf + "?format=safetensors", hf + "_back", hf + "_file", hf + "_to"):
        shutil.rmtree(p, ignore_errors=True)
    doc, _ = dcp_json("convert", a, hf + "?format=safetensors")
    check(doc["to"] == "safetensors" and doc["entries"] == 9, str(doc))
    check(not os.path.exists(hf + "?format=safetensors"), "wrote a directory named with its query")
    check(os.path.exists(os.path.join(hf, "model.safetensors.index.json")), str(os.listdir(hf)))
    check(not os.path.exists(os.path.join(hf, "metadata.dcp")), str(os.listdir(hf)))
    for where in (hf, hf + "?format=safetensors"):
        check(inspect_json(where)["format"] == "safetensors", where)
    # Back to dcp from the path with its query: the values are the source's.
    dcp("convert", hf + "?format=safetensors", hf + "_back")
    _, out = dcp("diff", a, hf + "_back", "--values")
    contains(out, "no differences")
    # file:// and --to say the same: Hugging Face's layout in a directory, not one local file.
    dcp("convert", a, "file://" + hf + "_file?format=safetensors")
    dcp("convert", a, hf + "_to?direct_io=0", "--to", "safetensors")
    for d in (hf + "_file", hf + "_to"):
        check(inspect_json(d)["format"] == "safetensors", d)
        check(not os.path.exists(d + "?direct_io=0"), d)
    # A backend option file:// does not know is refused (usage, 2), as on file://.
    _, out = dcp("convert", a, hf + "_x?colour=blue", expect=2)
    contains(out, "colour")
    check(not os.path.exists(hf + "_x?colour=blue"), "wrote a directory named with its query")
    # A '?' that starts no query is refused, naming the rule.
    _, out = dcp("inspect", a + "?1", expect=2)
    contains(out, "not key=value", "file://")


def dcp_json(*a, expect=0):
    """Run `dcp A... --json`: check the exit code and that stdout is exactly one JSON document."""
    cmd = [str(args.dcp), *map(str, a), "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    what = " ".join(cmd)
    check(p.returncode == expect,
          f"{what}: exit {p.returncode}, expected {expect}\n{p.stdout}{p.stderr}")
    try:
        doc = json.loads(p.stdout)
    except json.JSONDecodeError as e:
        sys.exit(f"FAIL: {what}: stdout is not one JSON document ({e}):\n{p.stdout}")
    return doc, p.stderr


def write_safetensors(path, tensors):
    """A safetensors file from {name: (dtype, shape, raw bytes)} (standard library only)."""
    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text + data)


def test_json(a, b):
    """--json on verify, diff and convert: one document, the same exit codes as the text form,
    and values that match the checkpoints (not only the keys)."""
    info = inspect_json(a)
    stored = sum(e["bytes"] for e in info["entries"])

    # verify: a sound checkpoint.
    doc, err = dcp_json("verify", a)
    check(doc["ok"] is True and doc["exit_code"] == 0 and doc["format"] == "dcp", str(doc))
    check(doc["checkpoint"] == info["uri"] and doc["checkpoint"].endswith("/a"), str(doc))
    check((doc["entries"], doc["items"], doc["files"]) == (9, 12, 2), str(doc))
    check(doc["stored_bytes"] == stored and doc["bytes_read"] == stored, f"{doc} vs {stored}")
    check(doc["items_checksum_verified"] == 12 and doc["items_without_checksum"] == 0, str(doc))
    check(doc["problems"] == [] and doc["warnings"] == [] and doc["unreferenced_files"] == 0,
          str(doc))
    check(doc["summary"].startswith("OK: ") and err == "", doc["summary"] + err)

    # verify: a flipped byte in model.w's chunk [3, 0] is one problem naming file, entry, chunk.
    d = fresh("json-flip")
    w0 = w_chunk(d)
    path = os.path.join(d, w0["file"])
    data = bytearray(open(path, "rb").read())
    data[w0["offset"] + 7] ^= 0x01
    open(path, "wb").write(data)
    doc, _ = dcp_json("verify", d, expect=1)
    check(doc["ok"] is False and doc["exit_code"] == 1 and len(doc["problems"]) == 1, str(doc))
    p = doc["problems"][0]
    check(p["kind"] == "checksum_mismatch" and p["file"] == w0["file"] and
          p["entry"] == "model.w" and p["chunk"] == [3, 0] and p["category"] == "damaged_data",
          str(p))
    check(p["message"].startswith("checksum mismatch: 'model.w' chunk [3, 0]") and
          f"at offset {w0['offset']}" in p["message"], p["message"])
    check(doc["items_checksum_verified"] == 11 and doc["summary"].startswith("FAILED: "), str(doc))
    # ...and diff --values, which reads it, fails with a JSON error of the same exit code.
    doc, err = dcp_json("diff", d, a, "--values", expect=1)
    check(list(doc) == ["error"] and doc["error"]["category"] == "damaged_data" and
          doc["error"]["exit_code"] == 1 and "checksum mismatch" in doc["error"]["message"],
          str(doc))
    contains(err, "dcp: error: damaged data", "model.w")

    # verify: a missing data file is a problem per item it held, each naming the file.
    d = fresh("json-missing")
    w0 = w_chunk(d)
    held = [(e["fqn"], c.get("offsets", [])) for e in inspect_json(d)["entries"]
            for c in e["chunks"] if c["file"] == w0["file"]]
    os.remove(os.path.join(d, w0["file"]))
    doc, _ = dcp_json("verify", d, expect=1)
    check(len(doc["problems"]) == len(held) and
          all(p["kind"] == "missing_file" and p["file"] == w0["file"] for p in doc["problems"]),
          f"{doc['problems']} vs {held}")
    check(sorted((p["entry"], p["chunk"] or []) for p in doc["problems"]) == sorted(held),
          f"{doc['problems']} vs {held}")
    check(doc["bytes_read"] < stored, str(doc))

    # verify: 25 stray data files are warnings (still ok): 20 named with their sizes, 5 counted.
    d = fresh("json-strays")
    strays = {f"data-stray{i:02d}-r0-b0.data" for i in range(25)}
    for name in strays:
        open(os.path.join(d, name), "wb").write(b"xyz")
    doc, _ = dcp_json("verify", d)
    check(doc["ok"] is True and doc["exit_code"] == 0 and doc["unreferenced_files"] == 25,
          str(doc))
    named = [w for w in doc["warnings"] if w["kind"] == "unreferenced_file"]
    check(len(named) == 20 and all(w["file"] in strays and w["bytes"] == 3 for w in named),
          str(named))
    more = [w for w in doc["warnings"] if w["kind"] == "more_unreferenced_files"]
    check(len(more) == 1 and more[0]["count"] == 5 and
          more[0]["message"] == "... and 5 more unreferenced data files", str(more))
    check(len(doc["warnings"]) == 21, str(doc["warnings"]))

    # verify: an unknown transform is unsupported (6), in the problem and the exit code.
    d = os.path.join(args.workdir, "json-rot13")
    shutil.rmtree(d, ignore_errors=True)
    run(args.fixture, d, "--hostile", "rot13", expect=0)
    doc, _ = dcp_json("verify", d, expect=6)
    check(doc["exit_code"] == 6 and [p["kind"] for p in doc["problems"]] ==
          ["unsupported_transform"] and doc["problems"][0]["entry"] == "rng" and
          doc["problems"][0]["category"] == "unsupported", str(doc))

    # diff: no differences, by stored checksum.
    doc, _ = dcp_json("diff", a, a)
    check(doc["identical"] is True and doc["exit_code"] == 0 and doc["mode"] == "checksums",
          str(doc))
    check("tolerances" not in doc and doc["differences"] == [] and doc["not_compared"] == [],
          str(doc))
    s = doc["summary"]
    check((s["entries_a"], s["entries_b"], s["common_entries"], s["differences"],
           s["compared_by_checksum"], s["compared_by_value"]) == (9, 9, 9, 0, 9, 0), str(s))

    # diff: model.w differs (checksums, then values with and without tolerance).
    doc, _ = dcp_json("diff", a, b, expect=1)
    check(doc["identical"] is False and doc["exit_code"] == 1, str(doc))
    check([(x["entry"], x["kind"], x["details"]) for x in doc["differences"]] ==
          [("model.w", "checksum", {"differing_chunks": 1, "chunks": 2})], str(doc["differences"]))
    check(doc["summary"]["differences"] == 1, str(doc["summary"]))
    doc, _ = dcp_json("diff", a, b, "--values", "--atol", "0.1", expect=1)
    check(doc["mode"] == "values" and doc["tolerances"] == {"atol": 0.1, "rtol": 0.0}, str(doc))
    check(len(doc["differences"]) == 1, str(doc["differences"]))
    x = doc["differences"][0]
    check(x["entry"] == "model.w" and x["kind"] == "values", str(x))
    det = x["details"]
    check(det["differing_elements"] == 1 and det["compared_elements"] == 30 and
          det["max_abs_diff"] == 0.5 and abs(det["max_rel_diff"] - 0.5 / 12.75) < 1e-9, str(det))
    check(doc["summary"]["compared_by_value"] == 9, str(doc["summary"]))
    doc, _ = dcp_json("diff", a, b, "--values", "--atol", "0.6", "--rtol", "0.01")
    check(doc["identical"] is True and doc["differences"] == [] and
          doc["tolerances"] == {"atol": 0.6, "rtol": 0.01}, str(doc))

    # diff: entries whose items are compressed on one side cannot be compared by checksum.
    z = fresh("json-z", zstd=True)
    compressed = sorted({e["fqn"] for e in inspect_json(z)["entries"]
                         if any(c["transforms"] == ["zstd"] for c in e["chunks"])})
    doc, _ = dcp_json("diff", a, z)
    check(doc["identical"] is True and compressed and
          sorted(n["entry"] for n in doc["not_compared"]) == compressed and
          all(n["reason"] == "compressed (zstd) in B" for n in doc["not_compared"]), str(doc))
    check(doc["summary"]["not_compared"] == len(compressed) and
          doc["summary"]["compared_by_checksum"] == 9 - len(compressed), str(doc["summary"]))

    # diff: entries only in one side, a dtype and a shape difference (checkpoints converted from
    # hand-written safetensors files).
    f32 = struct.pack("<2f", 1, 2)
    sa = os.path.join(args.workdir, "json-a.safetensors")
    sb = os.path.join(args.workdir, "json-b.safetensors")
    write_safetensors(sa, {"x": ("F32", [2], f32), "y": ("F32", [2], f32),
                           "same": ("F32", [2], f32), "gone": ("F32", [2], f32)})
    write_safetensors(sb, {"x": ("F64", [2], struct.pack("<2d", 1, 2)),
                           "y": ("F32", [1], f32[:4]), "same": ("F32", [2], f32),
                           "new": ("I8", [1], b"\x07")})
    da, db = os.path.join(args.workdir, "json-da"), os.path.join(args.workdir, "json-db")
    for st, dd in ((sa, da), (sb, db)):
        shutil.rmtree(dd, ignore_errors=True)
        doc, _ = dcp_json("convert", st, dd)
        check(doc["from"] == "safetensors" and doc["to"] == "dcp" and doc["entries"] == 4, str(doc))
    for extra in ([], ["--values"]):
        doc, _ = dcp_json("diff", da, db, *extra, expect=1)
        got = sorted((x["entry"], x["kind"]) for x in doc["differences"])
        check(got == [("gone", "only_in_a"), ("new", "only_in_b"), ("x", "dtype"), ("y", "shape")],
              f"{extra}: {got}")
        by = {x["entry"]: x for x in doc["differences"]}
        check(by["x"]["details"] == {"a": "float32", "b": "float64"} and
              by["y"]["details"] == {"a": [2], "b": [1]}, str(by))
        check(doc["summary"]["differences"] == 4 and doc["summary"]["common_entries"] == 3,
              str(doc["summary"]))

    # convert: to safetensors (a file) and to dcp (a checkpoint), with what was written.
    st = os.path.join(args.workdir, "json.safetensors")
    if os.path.exists(st):
        os.remove(st)
    doc, _ = dcp_json("convert", a, st)
    check(doc == {"ok": True, "source": a, "destination": st, "from": "dcp", "to": "safetensors",
                  "compression": "none", "overwrite": False, "entries": 9,
                  "bytes_written": os.path.getsize(st)}, str(doc))
    back = os.path.join(args.workdir, "json-back")
    shutil.rmtree(back, ignore_errors=True)
    doc, _ = dcp_json("convert", st, back, "--compress", "zstd")
    check(doc["from"] == "safetensors" and doc["to"] == "dcp" and doc["entries"] == 9 and
          doc["compression"] == "zstd", str(doc))
    check(doc["bytes_written"] == sum(e["bytes"] for e in inspect_json(back)["entries"]), str(doc))

    # Errors: a JSON error object on stdout, the message on stderr, the usual exit code.
    missing = os.path.join(args.workdir, "json-nosuch")
    for cmd in (("verify", missing), ("diff", a, missing), ("inspect", missing),
                ("convert", missing, st + ".x")):
        doc, err = dcp_json(*cmd, expect=3)
        check(list(doc) == ["error"] and doc["error"]["category"] == "not_checkpoint" and
              doc["error"]["exit_code"] == 3 and "not a checkpoint" in doc["error"]["message"],
              f"{cmd}: {doc}")
        contains(err, "dcp: error: " + doc["error"]["message"])
    doc, _ = dcp_json("convert", a, st, expect=2)  # exists
    check(doc["error"]["category"] == "usage" and "--overwrite" in doc["error"]["message"],
          str(doc))
    doc, _ = dcp_json("verify", expect=2)  # a bad command line
    check(doc["error"]["category"] == "usage" and doc["error"]["exit_code"] == 2, str(doc))
    d = fresh("json-incomplete")
    os.remove(os.path.join(d, "metadata.dcp"))
    doc, _ = dcp_json("verify", d, expect=4)
    check(doc["error"]["category"] == "incomplete_checkpoint", str(doc))


def test_flag_hints(a):
    """Errors the library raises naming its option fields name the CLI's flags instead."""
    dst = fresh("hint-dst")
    for run_it in (lambda: dcp("convert", a, dst, expect=2),
                   lambda: (0, dcp_json("convert", a, dst, expect=2)[0]["error"]["message"])):
        _, out = run_it()
        contains(out, "a checkpoint already exists at", "use --overwrite to replace it")
        check("pass overwrite" not in out and "rank 0" not in out, out)
    dcp("convert", a, dst, "--overwrite")
    st = os.path.join(args.workdir, "hint.safetensors")
    if os.path.exists(st):
        os.remove(st)
    dcp("convert", a, st)
    _, out = dcp("convert", st, os.path.join(args.workdir, "hint-z"), "--compress", "zstd",
                 "--compress-level", "99", expect=2)
    contains(out, "--compress-level 99 is outside zstd's range")
    check("compression_level" not in out, out)


def bounded(*a, expect, limit_as=None, cpu_seconds=2.0):
    """Run dcp with `a`; check the exit code, that it took < `cpu_seconds` of CPU and peaked
    below 200 MiB RSS. CPU time, not wall time: a loaded machine (CI runs tests in parallel) stretches the
    latter, and what a hostile input may cost is work."""
    def limit():
        if limit_as:
            resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))
    t0 = time.monotonic()
    p = subprocess.Popen([str(args.dcp), *map(str, a)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, preexec_fn=limit)
    out = p.stdout.read()
    p.stdout.close()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.monotonic() - t0
    cpu = usage.ru_utime + usage.ru_stime
    peak_mib = usage.ru_maxrss / 1024
    what = f"dcp {' '.join(map(str, a))}"
    check(p.returncode == expect, f"{what}: exit {p.returncode}, expected {expect}\n{out}")
    check(cpu < cpu_seconds, f"{what}: took {cpu:.2f} s of CPU ({seconds:.2f} s)")
    check(peak_mib < 200, f"{what}: peak RSS {peak_mib:.0f} MiB")
    return out


def test_hostile(good):
    """Hostile checkpoints (dcp_cli_fixture --hostile): every command refuses them fast and
    small, with the same exit code for the same damage."""
    def hostile(kind, zstd=False):
        path = os.path.join(args.workdir, "hostile-" + kind)
        shutil.rmtree(path, ignore_errors=True)
        run(args.fixture, path, "--hostile", kind, *(["--zstd"] if zstd else []), expect=0)
        return path

    def convert(d, expect):
        out_file = os.path.join(args.workdir, "hostile.safetensors")
        return bounded("convert", d, out_file, "--overwrite", expect=expect)

    # A blob claiming 8 GiB in a small file: damaged data (1) everywhere, nothing allocated.
    d = hostile("blob-8g")
    for out in (bounded("verify", d, expect=1), convert(d, 1),
                bounded("diff", d, good, "--values", expect=1)):
        contains(out, "truncated file", "'rng'")
    # A zstd blob with raw_length 8 GiB: more than its frame can hold, so corrupt metadata (5).
    d = hostile("zstd-8g")
    for out in (bounded("inspect", d, expect=5), bounded("verify", d, expect=5), convert(d, 5)):
        contains(out, "'rng'", "zstd")
    # Load's rules in verify: an unknown transform or an undefined chain is unsupported (6).
    for kind, t in (("rot13", "rot13"), ("zstd-zstd", "zstd,zstd")):
        d = hostile(kind)
        contains(bounded("verify", d, expect=6), f"uses transform '{t}'", "'rng'")
        contains(convert(d, 6), "'rng'")
    # Every checksum stripped: not "checksums verified", and the count is reported.
    d = hostile("no-crc")
    out = bounded("verify", d, expect=0)
    contains(out, "12 of 12 items carried no checksum", "NO item carried a checksum")
    check("checksums, sizes" not in out, out)
    # Inconsistent key paths and a nested relative_path: invalid metadata (5), naming the entry.
    for kind, entry in (("key-path", "'model.w'"), ("nested", "'rng.state'"), ("slash", "'rng'")):
        d = hostile(kind)
        for out in (bounded("inspect", d, expect=5), bounded("verify", d, expect=5),
                    convert(d, 5)):
            contains(out, entry)
            check("state dict" not in out, out)
    # A leftover temporary metadata file: a warning.
    d = hostile("tmp")
    contains(bounded("verify", d, expect=0), "leftover temporary metadata file "
             "'metadata.dcp.tmp.0123abcd'", "OK:")
    # Stray data files: the first 20 named with their sizes (a HEAD each on s3://), the rest counted.
    d = fresh("hostile-strays")
    for i in range(25):
        open(os.path.join(d, f"data-stray{i:02d}-r0-b0.data"), "wb").write(b"x")
    out = bounded("verify", d, expect=0)
    contains(out, "... and 5 more unreferenced data files", "OK:")
    check(out.count("unreferenced data file '") == 20, out)
    # Same damage, same exit code: a missing and a truncated data file are 1 in verify and convert.
    for damage in ("missing", "truncated"):
        d = fresh("hostile-" + damage)
        w0 = w_chunk(d)
        path = os.path.join(d, w0["file"])
        if damage == "missing":
            os.remove(path)
        else:
            os.truncate(path, w0["offset"] + 4)
        contains(bounded("verify", d, expect=1), damage if damage == "missing" else "truncated")
        contains(convert(d, 1), w0["file"])
    # A PyTorch DCP checkpoint (torch 2.11's fixture) with one bit flipped in a tensor's storage:
    # every command that reads values checks the record's zip CRC-32, as verify does (1).
    fixtures = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures",
                            "pytorch-dcp-2.11")
    # inspect of a PyTorch DCP directory: the world size comes from the data file names
    # (__<rank>_<n>.distcp; 4 ranks wrote dist4_dtensor), and torch records no date.
    _, out = dcp("inspect", os.path.join(fixtures, "dist4_dtensor"))
    contains(out, "world size      4 (from data file names)", "created         not recorded")
    _, out = dcp("inspect", os.path.join(fixtures, "dist4_dtensor"), "--json")
    doc = json.loads(out)
    check(doc["world_size"] == 4 and doc["world_size_source"] == "data file names" and
          doc["created"] is None, str({k: doc[k] for k in ("world_size", "created")}))
    d = os.path.join(args.workdir, "torch-flipped")
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(os.path.join(fixtures, "single_dtypes"), d)
    raw = open(os.path.join(fixtures, "single_dtypes.expected.safetensors"), "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    spec = json.loads(raw[8:8 + n])["dtypes.float32"]
    values = raw[8 + n + spec["data_offsets"][0]:8 + n + spec["data_offsets"][1]]
    data = os.path.join(d, "__0_0.distcp")
    blob = bytearray(open(data, "rb").read())
    at = blob.find(values)
    check(at > 0 and blob.find(values, at + 1) < 0, "the values of dtypes.float32 are not unique")
    blob[at + 7] ^= 0x10
    open(data, "wb").write(bytes(blob))
    for out in (bounded("verify", d, expect=1), convert(d, 1),
                bounded("diff", d, os.path.join(fixtures, "single_dtypes"), "--values", expect=1)):
        contains(out, "dtypes.float32", "CRC")
    # Sparse metadata files of 4 GiB (issue 44, item 5): the header of dcp's, or the first byte
    # of PyTorch's pickle, is checked after one small read, and a size over what any reader can
    # decode is refused before the rest is read, by every command, as by a load.
    for name, head, code, needle in (
            ("metadata.dcp", b"not metadata at all, 4 GiB of it", 3, "not a dcp metadata file"),
            ("metadata.dcp", b"DCPMETA1" + struct.pack("<IIQ", 2, 0, (4 << 30) - 24), 5,
             "over the limit of"),
            (".metadata", b"PK\x03\x04 a zip, not a pickle", 5, "not a pickle torch wrote"),
            (".metadata", b"\x80\x04 a pickle too large to be metadata", 5,
             "over the limit of")):
        d = os.path.join(args.workdir, "hostile-sparse-metadata")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        with open(os.path.join(d, name), "wb") as f:
            f.write(head)
            f.truncate(4 << 30)
        for cmd in ("inspect", "verify"):
            contains(bounded(cmd, d, expect=code), needle, name)
        contains(convert(d, code), needle)
    # Version 2: a rule claiming 2^30 chunks (of no bytes) over 2 ranks' files, and a sparse
    # 1 GiB index: corrupt metadata (5) from the counts, before a read item per chunk is made or
    # the index is read.
    for kind, needles in (("v2-chunks", ("exceed what is stored",)),
                          ("v2-index-1g", ("rank 0", "attributes"))):
        d = hostile(kind)
        for out in (bounded("inspect", d, expect=5), bounded("verify", d, expect=5),
                    convert(d, 5)):
            contains(out, *needles)
    # A blob the data backs (a sparse 2 GiB file) but memory cannot: a resource error naming the
    # entry, the file and the size (7), not a bare std::bad_alloc.
    d = hostile("alloc-2g")
    out = bounded("convert", d, os.path.join(args.workdir, "x.safetensors"), "--overwrite",
                  expect=7, limit_as=1 << 30)
    contains(out, "out of memory", "'rng'", "data-ffffffffffffffff-r0-b0.data", "2147483648")


def stored_zip(entries):
    """A zip of stored entries [(name, data)], as torch.save writes one."""
    le = lambda v, n: v.to_bytes(n, "little")
    out, central = b"", b""
    for name, data in entries:
        at, crc = len(out), zlib.crc32(data)
        sizes = le(crc, 4) + le(len(data), 4) * 2 + le(len(name), 2)
        out += le(0x04034b50, 4) + le(20, 2) + le(0, 8) + sizes + le(0, 2) + name + data
        central += (le(0x02014b50, 4) + le(20, 2) * 2 + le(0, 8) + sizes + le(0, 8) + le(0, 4) +
                    le(at, 4) + name)
    return (out + central + le(0x06054b50, 4) + le(0, 4) + le(len(entries), 2) * 2 +
            le(len(central), 4) + le(len(out), 4) + le(0, 2))


def test_hostile_torch_save():
    """Crafted torch.save files (issue 44, case 6): dcp convert refuses them fast and small,
    naming the file and what is at fault."""
    work = fresh("hostile-pt")
    pstr = lambda s: b"X" + len(s).to_bytes(4, "little") + s

    def tensor(numel, size, stride):
        return (b"ctorch._utils\n_rebuild_tensor_v2\n((" + pstr(b"storage") +
                b"ctorch\nFloatStorage\n" + pstr(b"0") + pstr(b"cpu") + b"J" +
                numel.to_bytes(4, "little") + b"tQK\x00J" + size.to_bytes(4, "little") +
                b"\x85J" + stride.to_bytes(4, "little") +
                b"\x85\x89ccollections\nOrderedDict\n)RtR")

    def convert(name, entries, expect):
        path = os.path.join(work, name + ".pt")
        open(path, "wb").write(stored_zip(entries))
        return bounded("convert", path, os.path.join(work, name), expect=expect)

    # {"a": d, "b": d} nested 40 times by memo references: 2^40 entries from 500 bytes.
    pkl = b"\x80\x02}q\x00(" + pstr(b"k") + b"K\x01u"
    for i in range(1, 41):
        pkl += b"0}q" + bytes([i]) + b"(" + pstr(b"a") + b"h" + bytes([i - 1]) + pstr(b"b") + \
            b"h" + bytes([i - 1]) + b"u"
    out = convert("dag", [(b"archive/data.pkl", pkl + b".")], 3)
    contains(out, "dag.pt' archive/data.pkl: invalid pickle", "expand it to more than")
    # A stride-0 view of one float as 2^28 elements (1 GiB once written).
    one = b"\x01\x00\x00\x00"
    pkl = b"\x80\x02}(" + pstr(b"w") + tensor(1, 1 << 28, 0) + b"u."
    out = convert("expanded", [(b"archive/data.pkl", pkl), (b"archive/data/0", one)], 6)
    contains(out, "expanded.pt': tensor 'w' views 1073741824 bytes of a storage of 4")
    # 64 tensors viewing one 256 KiB storage: 16 MiB from a 270 KiB file.
    storage = bytes(range(256)) * 1024
    pkl = b"\x80\x02}(" + b"".join(pstr(b"t%d" % i) + tensor(1 << 16, 1 << 16, 1)
                                    for i in range(64)) + b"u."
    out = convert("shared", [(b"archive/data.pkl", pkl), (b"archive/data/0", storage)], 6)
    contains(out, "shared.pt': its tensors view more than", "8 times the file")
    # A 60 KiB name of 30001 dotted parts (each a level of nesting where it is written).
    pkl = b"\x80\x02}(" + pstr(b"a." * 30000 + b"w") + b"K\x01u."
    out = convert("longname", [(b"archive/data.pkl", pkl)], 6)
    contains(out, "longname.pt': the name 'a.a.a.", "has 60001 bytes in 30001 dotted parts")
    # A flipped bit in the storage: its zip CRC-32 is checked, not copied into the checkpoint.
    pkl = b"\x80\x02}(" + pstr(b"w") + tensor(1 << 16, 1 << 16, 1) + b"u."
    data = stored_zip([(b"archive/data.pkl", pkl), (b"archive/data/0", storage)])
    at = data.find(storage) + 1000
    data = data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1:]
    path = os.path.join(work, "flipped.pt")
    open(path, "wb").write(data)
    out = bounded("convert", path, os.path.join(work, "flipped"), expect=3)
    contains(out, "flipped.pt' entry archive/data/0 fails its CRC-32")


def run_bytes(*a):
    """Run dcp with `a`: (exit code, stdout + stderr as bytes, untranslated: a CR stays a CR)."""
    p = subprocess.run([str(args.dcp), *map(str, a)], capture_output=True)
    return p.returncode, p.stdout + p.stderr


def safetensors_bytes(header_text, data=b""):
    return struct.pack("<Q", len(header_text)) + header_text + data


def test_hostile_safetensors():
    """Hostile safetensors files: what a file holds reaches the terminal escaped, and convert
    refuses what verify refuses, with the same message, fast and small."""
    work = os.path.join(args.workdir, "hostile-st")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    test_safetensors_names_escaped(work)
    test_safetensors_convert_refuses(work)
    test_safetensors_export_many_entries(work)


def test_safetensors_names_escaped(work):
    """Every string from a file that the commands print is escaped."""
    # Names with terminal escape codes (colour, clear screen, title), a CR that would overwrite
    # the line, a BEL and a C1 CSI (U+009B): never raw on stdout or stderr; valid UTF-8 stays.
    evil = "w\x1b[31mred\x1b[2J\x1b]0;title\x07\rover\u009b1m-\u00e9"
    f32 = struct.pack("<2f", 1, 2)
    a = os.path.join(work, "a.safetensors")
    b = os.path.join(work, "b.safetensors")
    write_safetensors(a, {evil: ("F32", [2], f32), "ok": ("F32", [2], f32)})
    write_safetensors(b, {evil: ("F32", [2], struct.pack("<2f", 1, 3)), "ok": ("F32", [2], f32)})
    raw = [b"\x1b", b"\r", b"\x07", "\u009b".encode()]
    escaped = b"w\\x1b[31mred\\x1b[2J\\x1b]0;title\\x07\\x0dover\\u009b1m-" + "\u00e9".encode()

    def clean(out, what):
        for r in raw:
            check(r not in out, f"{what}: raw {r!r} in the output:\n{out!r}")

    for cmd, expect, shown in ((("inspect", a), 0, True), (("verify", a), 0, False),
                               (("diff", a, b, "--values"), 1, True)):
        rc, out = run_bytes(*cmd)
        check(rc == expect, f"dcp {' '.join(cmd)}: exit {rc}\n{out!r}")
        clean(out, cmd[0])
        check(escaped in out or not shown, f"{cmd[0]}: no escaped name in:\n{out!r}")
    # --json keeps the name exact (JSON escapes it).
    rc, out = run_bytes("inspect", a, "--json")
    clean(out, "inspect --json")
    check(evil in [e["fqn"] for e in json.loads(out)["entries"]], out.decode(errors="replace"))
    # Errors quoting a name or a file name from the checkpoint.
    bad = os.path.join(work, "bad.safetensors")
    open(bad, "wb").write(safetensors_bytes(json.dumps(
        {evil: {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode(), f32))
    for cmd in ("inspect", "verify", "convert"):
        rc, out = run_bytes(cmd, bad, *([os.path.join(work, "bad-out")] if cmd == "convert" else []))
        check(rc == 5, f"{cmd}: exit {rc}\n{out!r}")
        clean(out, cmd + " of a bad header")
        check(escaped in out and b"reach past" in out, f"{cmd}: {out!r}")
    hub = os.path.join(work, "hub")
    os.makedirs(hub)
    open(os.path.join(hub, "model.safetensors.index.json"), "w").write(json.dumps(
        {"weight_map": {"w": "m\x1b[2Jx.safetensors"}}))
    rc, out = run_bytes("inspect", hub)
    check(rc == 1, f"inspect of an index naming a missing file: exit {rc}\n{out!r}")
    clean(out, "inspect of an index naming a missing file")
    check(b"m\\x1b[2Jx.safetensors" in out, repr(out))


def test_safetensors_export_many_entries(work):
    """A checkpoint of 100,000 entries converts to safetensors in linear time (issue 44: the
    header was built in an ordered JSON object whose every insert searched it: 11 s of CPU
    here, now 3)."""
    n = 100000
    header = {f"layer.{i}.w": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]}
              for i in range(n)}
    src = os.path.join(work, "many.safetensors")
    data = bytes(i % 251 for i in range(n))
    open(src, "wb").write(safetensors_bytes(json.dumps(header).encode(), data))
    mid = os.path.join(work, "many-dcp")
    dcp("convert", src, mid, "--overwrite")
    out = bounded("convert", mid, os.path.join(work, "many-back.safetensors"), "--overwrite",
                  expect=0, cpu_seconds=6.0)
    raw = open(os.path.join(work, "many-back.safetensors"), "rb").read()
    (m,) = struct.unpack("<Q", raw[:8])
    back = json.loads(raw[8:8 + m])
    check(len(back) == n + 1 and back[f"layer.{n - 1}.w"]["shape"] == [1], out)
    for i in (0, 12345, n - 1):
        at = 8 + m + back[f"layer.{i}.w"]["data_offsets"][0]
        check(raw[at] == data[i], f"layer.{i}.w: {raw[at]} != {data[i]}")


def test_safetensors_convert_refuses(work):
    """convert reads a file through the reader verify uses (it used to parse the header itself,
    without the reader's bounds and checks): what verify refuses, convert refuses with the same
    message, fast and small. Among them a 50 MiB header that the bounds refuse after its first
    KiB (the old convert parsed it whole: 112 s, 4.3 GB)."""
    good = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    cases = {
        "long-shape": safetensors_bytes(b'{"w":{"dtype":"F32","shape":[' + b"1," * 2000 +
                                        b'1],"data_offsets":[0,4]}}', bytes(4)),
        "overlap": safetensors_bytes(json.dumps(
            {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
             "v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode(), bytes(12)),
        "nul-padding": safetensors_bytes(good + b"\0" * 5, bytes(8)),
        "bom": safetensors_bytes(b"\xef\xbb\xbf" + good, bytes(8)),
        "huge": safetensors_bytes(b'{"w":{"dtype":"F32","shape":[' + b"0," * (25 << 20) +
                                  b'0],"data_offsets":[0,0]}}'),
    }
    for name, content in cases.items():
        f = os.path.join(work, name + ".safetensors")
        open(f, "wb").write(content)
        verify = bounded("verify", f, expect=5)
        out_dir = os.path.join(work, name + "-dcp")
        shutil.rmtree(out_dir, ignore_errors=True)
        convert = bounded("convert", f, out_dir, expect=5)
        error = [line for line in verify.splitlines() if line.startswith("dcp: error:")]
        check(len(error) == 1 and error[0] in convert.splitlines(),
              f"{name}: verify says\n{verify}\nconvert says\n{convert}")
        check(not os.path.exists(out_dir), f"{name}: convert wrote {out_dir}")
        os.remove(f)


def read_safetensors(path):
    """An independent safetensors reader: standard library + numpy only."""
    import numpy as np
    types = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64,
             "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
             "BF16": np.uint16}
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    buf = raw[8 + n:]
    out, end = {}, 0
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        b, e = spec["data_offsets"]
        end = max(end, e)
        arr = np.frombuffer(buf[b:e], dtype=np.dtype(types[spec["dtype"]]).newbyteorder("<"))
        if spec["dtype"] == "BF16":  # numpy has no bfloat16: widen to float32
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr.reshape(spec["shape"])
    check(end == len(buf), f"data buffer has {len(buf)} bytes, tensors cover {end}")
    return header, out


def test_safetensors():
    try:
        import numpy as np
    except ImportError:
        print("numpy not available: skipped")
        sys.exit(SKIP)
    a = fresh("a")
    st = os.path.join(args.workdir, "a.safetensors")
    if os.path.exists(st):
        os.remove(st)
    _, out = dcp("convert", a, st)
    contains(out, "converted")
    header, tensors = read_safetensors(st)
    check(header["model.bf"]["dtype"] == "BF16" and header["mask"]["dtype"] == "BOOL", str(header))
    for name, want in expected().items():
        got = tensors[name]
        check(got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}")
        check(np.array_equal(got, want), f"{name}: values differ:\n{got}\n{want}")
    check(tensors["rng"].tobytes() == b"\x00\x01\xffstate", "blob bytes differ")
    check(json.loads(header["__metadata__"]["dcp.blobs"]) == ["rng"], str(header["__metadata__"]))
    dcp("convert", a, st, expect=2)  # refuses to overwrite...
    dcp("convert", a, st, "--overwrite", "--piece-mib", "1")  # ...unless asked
    # Tiny pieces: tensors are assembled index by index of an inner dimension, across the
    # column-sharded chunks of model.c; the result must be byte-identical.
    st_small = os.path.join(args.workdir, "small.safetensors")
    if os.path.exists(st_small):
        os.remove(st_small)
    for piece in ("8", "40", "100"):
        if os.path.exists(st_small):
            os.remove(st_small)
        dcp("convert", a, st_small, "--piece-bytes", piece)
        check(open(st_small, "rb").read() == open(st, "rb").read(),
              f"piece size {piece} changed the output")

    back = os.path.join(args.workdir, "from_st")
    shutil.rmtree(back, ignore_errors=True)
    dcp("convert", st, back)
    dcp("verify", back)
    _, out = dcp("diff", a, back, "--values")
    contains(out, "no differences")

    # A checkpoint with compressed items converts to the same safetensors values.
    z = fresh("z", zstd=True)
    st_z = os.path.join(args.workdir, "z.safetensors")
    if os.path.exists(st_z):
        os.remove(st_z)
    for extra in (["--piece-bytes", "8"], []):
        if os.path.exists(st_z):
            os.remove(st_z)
        dcp("convert", z, st_z, *extra)
        _, tz = read_safetensors(st_z)
        for name, want in tensors.items():
            check(np.array_equal(tz[name], want), f"{name} (compressed source, {extra})")
    # --compress zstd: a large compressible tensor is stored compressed, a small one raw.
    big = os.path.join(args.workdir, "big.safetensors")
    blob = (np.arange(65536, dtype=np.float32) % 7).tobytes()
    small = np.arange(4, dtype=np.float32).tobytes()
    header = json.dumps({"big": {"dtype": "F32", "shape": [256, 256], "data_offsets": [0, len(blob)]},
                         "small": {"dtype": "F32", "shape": [4],
                                   "data_offsets": [len(blob), len(blob) + len(small)]}}).encode()
    with open(big, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header + blob + small)
    zdir = os.path.join(args.workdir, "from_big")
    shutil.rmtree(zdir, ignore_errors=True)
    dcp("convert", big, zdir, "--compress", "zstd", "--compress-level", "5")
    by = {e["fqn"]: e for e in inspect_json(zdir)["entries"]}
    check(by["big"]["transform"] == "zstd" and by["small"]["transform"] == "raw", str(by))
    check(by["big"]["bytes"] < len(blob) // 10, str(by["big"]))
    dcp("verify", zdir)
    back_st = os.path.join(args.workdir, "from_big.safetensors")
    if os.path.exists(back_st):
        os.remove(back_st)
    dcp("convert", zdir, back_st)
    _, t = read_safetensors(back_st)
    check(t["big"].tobytes() == blob and t["small"].tobytes() == small, "compressed round trip")
    # --compress writes dcp items: refused for a safetensors destination...
    os.remove(back_st)
    _, out = dcp("convert", zdir, back_st, "--compress", "zstd", expect=2)
    contains(out, "--compress applies")
    # ...and re-compresses a dcp checkpoint converted to dcp (here at another level).
    rez = os.path.join(args.workdir, "from_big_rez")
    shutil.rmtree(rez, ignore_errors=True)
    dcp("convert", zdir, rez, "--compress", "zstd", "--compress-level", "1")
    _, out = dcp("diff", zdir, rez, "--values")
    contains(out, "no differences")

    # A Hugging Face sharded directory (written by numpy, tests/fixtures/safetensors) through the
    # safetensors layout: inspect, verify (no checksums: says so), convert to dcp, torchdcp and one
    # safetensors file, each bit-exact against the fixture's expected bytes.
    fixtures = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures",
                            "safetensors")
    hub = os.path.join(fixtures, "sharded")
    want = json.load(open(os.path.join(fixtures, "expected.json")))["sharded"]
    doc = inspect_json(hub)
    check(doc["format"] == "safetensors" and doc["world_size"] == 3 and doc["files"] == 3, str(doc))
    by = {e["fqn"]: e for e in doc["entries"]}
    check(set(by) == set(want), str(sorted(by)))
    check(by["model.embed_tokens.weight"]["dtype"] == "bfloat16" and
          by["model.layers.0.fp8_e4m3"]["dtype"] == "float8_e4m3fn", str(by))
    _, out = dcp("inspect", os.path.join(hub, "model-00001-of-00003.safetensors"))
    contains(out, "model.embed_tokens.weight")
    _, out = dcp("verify", hub)
    contains(out, "OK:", "safetensors stores none")
    v, _ = dcp_json("verify", hub)
    check(v["ok"] and v["items_without_checksum"] == len(want), str(v))
    hub_dcp = os.path.join(args.workdir, "hub_dcp")
    shutil.rmtree(hub_dcp, ignore_errors=True)
    doc, _ = dcp_json("convert", hub, hub_dcp)
    check(doc["from"] == "safetensors" and doc["to"] == "dcp" and doc["entries"] == len(want), str(doc))
    dcp("verify", hub_dcp)
    hub_torch = os.path.join(args.workdir, "hub_torch")
    shutil.rmtree(hub_torch, ignore_errors=True)
    dcp("convert", hub, hub_torch, "--to", "torchdcp")
    _, out = dcp("diff", hub_dcp, "torchdcp://" + hub_torch, "--values")
    contains(out, "no differences")
    merged = os.path.join(args.workdir, "hub_merged.safetensors")
    if os.path.exists(merged):
        os.remove(merged)
    dcp("convert", hub, merged)
    raw = open(merged, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    for name, t in want.items():
        b, e = header[name]["data_offsets"]
        check(header[name]["dtype"] == t["dtype"] and header[name]["shape"] == t["shape"], name)
        check(raw[8 + n + b:8 + n + e].hex() == t["hex"], f"{name}: bytes differ")
    # A damaged shard: a header whose offsets reach past the file is corrupt metadata (5).
    bad = os.path.join(args.workdir, "hub_bad")
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(hub, bad)
    f = os.path.join(bad, "model-00002-of-00003.safetensors")
    os.truncate(f, os.path.getsize(f) - 1)
    _, out = dcp("inspect", bad, expect=5)
    contains(out, "model-00002-of-00003.safetensors", "reach past")


def test_torch():
    if not args.torch_python:
        print("no Python interpreter with torch was found at configure time "
              "(DCP_TORCH_PYTHON): skipped")
        sys.exit(SKIP)
    check_torch = subprocess.run([args.torch_python, "-c", "import torch"], capture_output=True)
    if check_torch.returncode != 0:
        print(args.torch_python + " cannot import torch: skipped")
        sys.exit(SKIP)
    a = fresh("a")
    pt = os.path.join(args.workdir, "a.pt")
    if os.path.exists(pt):
        os.remove(pt)
    rc, out = dcp("convert", a, pt, expect=None)
    if rc == 6 and "without LibTorch" in out:
        print("dcp built without LibTorch: skipped")
        sys.exit(SKIP)
    check(rc == 0, out)
    script = r"""
import sys, torch
sd = torch.load(sys.argv[1])
w = torch.tensor([[i * 10 + j + 0.25 for j in range(5)] for i in range(6)], dtype=torch.float32)
c = torch.tensor([[(i - j) * 0.5 for j in range(6)] for i in range(4)], dtype=torch.float32)
assert torch.equal(sd["model.w"], w), sd["model.w"]
assert torch.equal(sd["model.c"], c), sd["model.c"]
assert sd["model.h"].dtype == torch.float16 and torch.equal(sd["model.h"].float(), (torch.arange(12) / 8).reshape(3, 4))
assert sd["model.bf"].dtype == torch.bfloat16 and torch.equal(sd["model.bf"].float(), torch.arange(5) - 2.5)
assert sd["step"].item() == 1234567890123 and sd["step"].dim() == 0
assert sd["mask"].tolist() == [i % 2 == 0 for i in range(7)]
assert sd["i8"].tolist() == [[-3, -2, -1], [0, 1, 2]]
assert sd["model.k"].dtype == torch.float64 and sd["model.k"][1, 2, 3].item() == 123
assert bytes(sd["rng"].tolist()) == b"\x00\x01\xffstate"
assert sd["__dcp_blobs__"] == ["rng"], sd["__dcp_blobs__"]
torch.save({"x": torch.arange(6, dtype=torch.float64).reshape(2, 3), "nested": {"y": torch.ones(3, dtype=torch.int32), "z": torch.zeros(2, 2, dtype=torch.bfloat16)}}, sys.argv[2])
print("torch.load ok")
"""
    src2 = os.path.join(args.workdir, "py.pt")
    rc, out = run(args.torch_python, "-c", script, pt, src2)
    check(rc == 0, "torch.load failed:\n" + out)
    back = os.path.join(args.workdir, "from_pt")
    shutil.rmtree(back, ignore_errors=True)
    dcp("convert", pt, back)
    _, out = dcp("diff", a, back, "--values")
    contains(out, "no differences")
    back2 = os.path.join(args.workdir, "from_py")
    shutil.rmtree(back2, ignore_errors=True)
    dcp("convert", src2, back2)
    doc = inspect_json(back2)
    by = {e["fqn"]: e for e in doc["entries"]}
    check(by["x"]["dtype"] == "float64" and by["x"]["shape"] == [2, 3], str(by))
    check(by["nested.y"]["dtype"] == "int32" and by["nested.z"]["dtype"] == "bfloat16", str(by))

    # torch.save files as torch writes them, read without LibTorch (a model's state_dict, a dict
    # of one entry, nested dicts with shared storages, views and plain values), then written
    # back through LibTorch: torch.load gives the same tensors, and the plain values.
    files = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures",
                         "torch-save-files")
    for name in ("state_dict", "one_entry", "mixed"):
        conv = os.path.join(args.workdir, "from_" + name)
        back_pt = os.path.join(args.workdir, name + "_back.pt")
        shutil.rmtree(conv, ignore_errors=True)
        if os.path.exists(back_pt):
            os.remove(back_pt)
        dcp("convert", os.path.join(files, name + ".pt"), conv)
        dcp("convert", conv, back_pt)
        compare = r'''
import sys, torch
def flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        name = prefix + str(k)
        if isinstance(v, dict):
            out.update(flat(v, name + "."))
        else:
            out[name] = v
    return out
src = flat(torch.load(sys.argv[1]))
back = torch.load(sys.argv[2])
for k, v in src.items():
    if isinstance(v, torch.Tensor):
        assert torch.equal(back[k], v) and back[k].dtype == v.dtype, k
    elif isinstance(v, bytes):
        assert bytes(back[k].tolist()) == v, k
    else:
        import io
        assert torch.load(io.BytesIO(bytes(back[k].tolist()))) == v, k
print(len(src), "entries equal")
'''
        rc, out = run(args.torch_python, "-c", compare, os.path.join(files, name + ".pt"), back_pt)
        check(rc == 0, name + ": " + out)
    for name, why in (("tensor_list", "'layers'"), ("bare_tensor", "not a dict")):
        rc, out = dcp("convert", os.path.join(files, name + ".pt"),
                      os.path.join(args.workdir, "from_" + name), expect=6)
        contains(out, why)
    # A dtype this LibTorch lacks is "unsupported" (6), not "out of memory".
    f8 = os.path.join(args.workdir, "f8.safetensors")
    write_safetensors(f8, {"q": ("F8_E4M3", [4], bytes([0x38, 0x40, 0x44, 0x48]))})
    f8_dir = os.path.join(args.workdir, "f8")
    shutil.rmtree(f8_dir, ignore_errors=True)
    dcp("convert", f8, f8_dir)
    rc, out = dcp("convert", f8_dir, os.path.join(args.workdir, "f8.pt"), expect=6)
    contains(out, "float8")


def test_plugin():
    if not args.plugin or not os.path.exists(args.plugin):
        print("no plugin built: skipped")
        sys.exit(SKIP)
    a = fresh("a")
    st = os.path.join(args.workdir, "a.safetensors")
    if os.path.exists(st):
        os.remove(st)
    dcp("convert", a, st)
    kvdir = os.path.join(args.workdir, "kv")
    shutil.rmtree(kvdir, ignore_errors=True)
    uri = "kv://" + kvdir
    _, out = dcp("inspect", uri, expect=2)  # scheme unknown without the plugin
    contains(out, "--plugin")
    dcp("--plugin", args.plugin, "convert", st, uri, "--to", "dcp")
    _, out = dcp("--plugin", args.plugin, "inspect", uri)
    contains(out, "kv://", "model.w", "8 tensors, 1 blobs")
    _, out = dcp("verify", uri, "--plugin", args.plugin)
    contains(out, "OK: kv://")
    _, out = dcp("--plugin", args.plugin, "diff", a, uri, "--values")
    contains(out, "no differences")


def s3_request(method, uri, data=None):
    """A raw request to the S3 test server with curl's own SigV4 (independent of dcp's client)."""
    bucket_key = uri[len("s3://"):]
    cmd = ["curl", "-sS", "-f", "--aws-sigv4", "aws:amz:" + os.environ.get("AWS_REGION", "us-east-1") + ":s3",
           "--user", os.environ["AWS_ACCESS_KEY_ID"] + ":" + os.environ["AWS_SECRET_ACCESS_KEY"],
           "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD", "-X", method]
    if data is not None:
        cmd += ["--data-binary", "@-"]
    p = subprocess.run(cmd + [os.environ["DCP_TEST_S3_ENDPOINT"] + "/" + bucket_key],
                       input=data, capture_output=True)
    check(p.returncode == 0, f"curl {method} {uri}: {p.stderr.decode()}")
    return p.stdout


def test_s3():
    """inspect, verify and diff over s3:// on the test server (Ceph RGW), and damage found there."""
    if not os.environ.get("DCP_TEST_S3_ENDPOINT"):
        print("SKIPPED: no S3 test server (DCP_TEST_S3_ENDPOINT is not set; tools/setup.sh test "
              "starts one)")
        sys.exit(SKIP)
    os.environ["AWS_ENDPOINT_URL"] = os.environ["DCP_TEST_S3_ENDPOINT"]
    a = fresh("a")
    uri = f"s3://dcp-test/cli-{os.getpid()}"
    run(args.fixture, uri, expect=0)  # a 2-rank save straight to s3://
    _, out = dcp("inspect", uri)
    contains(out, "world size      2", "model.w", "8 tensors, 1 blobs", "in 2 files")
    _, out = dcp("verify", uri)
    contains(out, "OK: " + uri, "12 stored items")
    _, out = dcp("diff", a, uri, "--values")
    contains(out, "no differences")
    # PyTorch DCP's layout on s3://: --to torchdcp (or ?format=torchdcp) writes it there, and
    # every command reads it back by detection.
    for dst, extra in ((uri + "-torch", ["--to", "torchdcp"]), (uri + "-torchq?format=torchdcp", [])):
        dcp("convert", a, dst, *extra)
        _, out = dcp("inspect", dst.split("?")[0], "--json")
        check(json.loads(out)["format"] == "torchdcp", f"{dst}: written as PyTorch DCP")
        _, out = dcp("diff", a, dst.split("?")[0], "--values")
        contains(out, "no differences")
    # A flipped byte in the stored object (rewritten through curl, not dcp) is found and named.
    w0 = w_chunk(uri)
    obj = uri + "/" + w0["file"]
    data = bytearray(s3_request("GET", obj))
    data[w0["offset"] + 7] ^= 0x01
    s3_request("PUT", obj, bytes(data))
    _, out = dcp("verify", uri, expect=1)
    contains(out, "checksum mismatch: 'model.w' chunk [3, 0]", w0["file"], "FAILED")


def main():
    global args
    p = argparse.ArgumentParser()
    p.add_argument("part", choices=["basic", "safetensors", "torch", "plugin", "s3", "incremental"])
    p.add_argument("--dcp", required=True)
    p.add_argument("--fixture", required=True)
    p.add_argument("--plugin", default="")
    p.add_argument("--workdir", required=True)
    p.add_argument("--torch-python", default="",
                   help="a Python with torch for the torch.load/torch.save checks ('' skips them)")
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    globals()["test_" + args.part]()
    print(f"cli {args.part}: ok")


if __name__ == "__main__":
    main()
