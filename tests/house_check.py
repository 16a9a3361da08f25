"""The shape the library keeps (issue 49): checked in CI on every change.

  - no library file (proto/ planner/ storage/ dcp/) over MAX_FILE_LINES lines;
  - no library function over MAX_FUNCTION_LINES lines, but the pickle interpreter's loop;
  - no include cycle between sub-folders (the folders' include graph has no strongly connected
    component of more than one folder);
  - no format-specific header (storage/format/ beyond its interface, layout.h) included outside
    storage/format/, but by the LibTorch adapter;
  - at most MAX_INSTALLED_HEADERS installed headers (with --build-dir: installs into a scratch
    prefix and counts);
  - no Catch assertion or message (CHECK*, REQUIRE*, FAIL*, INFO, ...) in the body of a lambda a
    test runs on another thread (RunRanks, std::thread, std::jthread, std::async, a thread
    vector's emplace_back): Catch 2's assertions are not thread-safe, and ranks asserting at once
    crash the test binary at random.

Usage: house_check.py REPO_ROOT [--build-dir BUILD [--cmake CMAKE]]
Functions are found by brace matching on code with comments and literals blanked out: a block at
namespace or class scope whose head is not a namespace, class, struct, union, enum or an
initializer (`= {`) is a function body, counted from its head's first line to its closing brace.
"""
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

LIBRARY_FOLDERS = ("proto", "planner", "storage", "dcp")
MAX_FILE_LINES = 1000
MAX_FUNCTION_LINES = 120
MAX_INSTALLED_HEADERS = 20
# (file, function) allowed past MAX_FUNCTION_LINES, and why.
LONG_FUNCTIONS = {
    ("storage/format/pickle.cc", "Run"): "the pickle interpreter: one switch over the opcodes",
}
FORMAT_INTERFACE = {"storage/format/layout.h"}
# Interop with torch's own formats: LibTorch's torch.save, and torch.distributed.checkpoint's
# planner, which hands the storage layer torch.save records (dcp.torch).
FORMAT_INCLUDERS = {"dcp/torch_adapter.cc", "dcp/python/torch_plugin.cc"}


def library_files(root):
    for folder in LIBRARY_FOLDERS:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix in (".cc", ".h", ".cu") and path.is_file():
                yield path


def blank_comments_and_literals(text):
    """The text with comments, string and char literals replaced by spaces (newlines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == 'R' and text.startswith('R"', i) and (i == 0 or not text[i - 1].isalnum()):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if not m:
                out.append(c)
                i += 1
                continue
            close = ")" + m.group(1) + '"'
            j = text.find(close, i + m.end())
            j = n if j < 0 else j + len(close)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isalnum() and i + 1 < n and text[i + 1].isalnum():
                out.append(" ")  # a digit separator: 1'000'000
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(" " * (j - i))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def functions(path):
    """(name, first line, line count) of every function body at namespace or class scope."""
    code = blank_comments_and_literals(path.read_text())
    code = re.sub(r"^[ \t]*#.*$", lambda m: " " * len(m.group(0)), code, flags=re.M)
    stack = []  # kind of each open block: "scope" (namespace, class), "function", "other"
    head_start = 0
    result = []
    for i, c in enumerate(code):
        if c == "{":
            head = code[head_start:i]
            in_scope = all(kind == "scope" for kind, _, _ in stack)
            if re.search(r"\b(namespace|class|struct|union|enum)\b[^()]*$", head) or \
                    re.search(r'\bextern\s*$', head):
                kind = "scope"
            elif in_scope and not re.search(r"=\s*$", head) and head.strip():
                kind = "function"
            else:
                kind = "other"
            stack.append((kind, head, head_start))
            head_start = i + 1
        elif c == "}":
            if stack:
                kind, head, start = stack.pop()
                if kind == "function":
                    first = start + len(head) - len(head.lstrip())
                    first_line = code.count("\n", 0, first) + 1
                    last_line = code.count("\n", 0, i) + 1
                    names = re.findall(r"([~\w]+)\s*\(", head)
                    name = names[0] if names else "?"
                    for candidate in names:
                        if candidate not in ("if", "for", "while", "switch", "return", "sizeof",
                                             "decltype", "alignas", "noexcept", "requires"):
                            name = candidate
                            break
                    result.append((name, first_line, last_line - first_line + 1))
            head_start = i + 1
        elif c == ";":
            if all(kind == "scope" for kind, _, _ in stack):
                head_start = i + 1
    return result


def folder_of(path, root):
    return str(path.parent.relative_to(root))


def include_graph(root):
    edges = {}
    for path in library_files(root):
        src = folder_of(path, root)
        for line_no, line in enumerate(path.read_text().split("\n"), 1):
            m = re.match(r'\s*#\s*include\s+"dcp/([^"]+)"', line)
            if not m:
                continue
            target = Path(m.group(1))
            if not (root / target).exists():
                continue  # generated (dcp_version.h) or another tree
            dst = str(target.parent)
            if dst != src:
                edges.setdefault(src, {}).setdefault(dst, f"{path.relative_to(root)}:{line_no}")
    return edges


def cycles(edges):
    """Strongly connected components of more than one folder (Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def installed_headers(build_dir, cmake):
    with tempfile.TemporaryDirectory() as prefix:
        subprocess.run([cmake, "--install", str(build_dir), "--prefix", prefix], check=True,
                       stdout=subprocess.DEVNULL)
        include = Path(prefix) / "include"
        return sorted(str(p.relative_to(include)) for p in include.rglob("*.h"))


# A lambda handed to something that runs it on another thread.
THREAD_LAMBDA = re.compile(
    r"(\bRunRanks\(|\bstd::j?thread\b\s*[({]?|\bstd::async\(|\.emplace_back\()[^;\[]*?"
    r"\[[^\]]*\]\s*(\([^)]*\))?\s*(mutable\s*)?(->\s*[\w:<>]+\s*)?\{")
ASSERTION = re.compile(r"\b(REQUIRE|CHECK|FAIL|INFO|UNSCOPED_INFO|CAPTURE|WARN|SUCCEED)\w*\s*\(")


def assertions_on_threads(path):
    """(line, assertion) of each Catch assertion inside a lambda run on another thread."""
    text = blank_comments_and_literals(path.read_text())
    for m in THREAD_LAMBDA.finditer(text):
        start, depth = m.end() - 1, 0
        for end in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                break
        for a in ASSERTION.finditer(text, start, end):
            yield text.count("\n", 0, a.start()) + 1, a.group(1)


def main():
    root = Path(sys.argv[1]).resolve()
    def flag(name, default=None):
        return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default
    build_dir, cmake = flag("--build-dir"), flag("--cmake", "cmake")
    problems = []
    for path in library_files(root):
        rel = str(path.relative_to(root))
        lines = path.read_text().count("\n")
        if lines > MAX_FILE_LINES:
            problems.append(f"{rel}: {lines} lines (at most {MAX_FILE_LINES}): split it by concept")
        for name, first, count in functions(path):
            if count > MAX_FUNCTION_LINES and (rel, name) not in LONG_FUNCTIONS:
                problems.append(f"{rel}:{first}: function {name} is {count} lines "
                                f"(at most {MAX_FUNCTION_LINES}): cut it into named steps")
        if rel.startswith("storage/format/") or rel in FORMAT_INCLUDERS:
            continue
        for line_no, line in enumerate(path.read_text().split("\n"), 1):
            m = re.match(r'\s*#\s*include\s+"dcp/(storage/format/[^"]+)"', line)
            if m and m.group(1) not in FORMAT_INTERFACE:
                problems.append(f"{rel}:{line_no}: includes {m.group(1)}: outside storage/format/ "
                                "only the format interface (layout.h) may be used")
    for path in sorted((root / "tests").rglob("*.cc")):
        for line_no, what in assertions_on_threads(path):
            problems.append(f"{path.relative_to(root)}:{line_no}: {what} inside a lambda run on "
                            "another thread: Catch's assertions are not thread-safe; record the "
                            "result and check it after the threads join")
    edges = include_graph(root)
    for comp in cycles(edges):
        links = [f"{a} -> {b} ({edges[a][b]})" for a in comp for b in comp if b in edges.get(a, {})]
        problems.append("include cycle between sub-folders " + ", ".join(comp) + ": " +
                        "; ".join(links))
    if build_dir:
        headers = installed_headers(build_dir, cmake)
        if len(headers) > MAX_INSTALLED_HEADERS:
            problems.append(f"{len(headers)} installed headers (at most {MAX_INSTALLED_HEADERS}): "
                            + ", ".join(headers))
    for p in problems:
        print(p)
    if problems:
        sys.exit(f"house check: {len(problems)} problem(s)")
    print("house check: files, functions, folder includes, test assertions"
          + (", installed headers" if build_dir else "") + ": all within bounds")


if __name__ == "__main__":
    main()
