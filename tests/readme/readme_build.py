"""README.md's code, as a reader would paste it.

Every ```cpp and ```cmake block of README.md is preceded by a marker saying how CI builds it
(a ```python block that carries a snippet marker quotes a file that a CTest runs):

  <!-- build: DIR/FILE -->         a whole file: the blocks of one DIR form a project (its
                                   CMakeLists.txt and sources), configured against the installed
                                   package, built and run (tests/package/run_consumer.cmake)
  <!-- build: fragment CONTEXT --> code a user pastes into a function of their program: its
                                   leading #include lines go to the top of a file, the rest into
                                   the body of a function whose parameters are what CONTEXT says
                                   the reader already has (CONTEXTS below); compiled
  <!-- snippet: FILE NAME -->      code quoted from FILE, between the comments [NAME] and
                                   [NAME-end], which the build compiles: the block must equal it

Usage:
  readme_build.py check REPO_ROOT            every block marked, every quoted block current
  readme_build.py write REPO_ROOT            copy quoted code into README.md
  readme_build.py extract REPO_ROOT OUT_DIR COMPONENTS
                                             write the projects and the fragments' project
                                             (fragments whose component is not in the
                                             ;-separated COMPONENTS are left out, and said)
"""
import re
import sys
from pathlib import Path

# CONTEXT -> (the dcp component it needs, the function's parameters, headers the parameters need)
CONTEXTS = {
    "state": (None, "dcp::StateDict& sd, dcp::Communicator& comm", []),
    "manager": ("MPI", "dcp::StateDict& sd, dcp::MpiCommunicator& comm, const std::string& dir, "
                "int64_t last_step, const std::function<void(dcp::StateDict&)>& train_step",
                ["<functional>", "<string>"]),
    "torch": ("Torch", "dcp::Communicator& comm, const std::string& dir", ["<string>"]),
    "torchrun": ("Torch", "dcp::StateDict& sd, const std::string& dir", ["<string>", "<utility>"]),
}
COMPONENT_TARGETS = {None: "dcp::dcp", "MPI": "dcp::dcp_mpi", "Torch": "dcp::dcp_torch"}


def dedent(lines):
    width = min((len(l) - len(l.lstrip()) for l in lines if l.strip()), default=0)
    return [l[width:].rstrip() for l in lines]


def blocks(readme):
    """(marker line index or None, language, first code line index, end fence index)."""
    i = 0
    while i < len(readme):
        m = re.match(r"\s*```(\w*)", readme[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(readme)) if readme[j].strip().startswith("```")),
                   None)
        if end is None:
            sys.exit(f"README.md:{i + 1}: a code block that never ends")
        marker = i - 1 if i > 0 and readme[i - 1].strip().startswith("<!--") else None
        yield marker, m.group(1), i + 1, end
        i = end + 1


def quoted_code(root, path, name):
    source = (root / path).read_text().split("\n")
    starts = [k for k, l in enumerate(source) if f"[{name}]" in l]
    ends = [k for k, l in enumerate(source) if f"[{name}-end]" in l]
    if len(starts) != 1 or len(ends) != 1:
        sys.exit(f"{path}: needs exactly one [{name}] and one [{name}-end] comment")
    return dedent(source[starts[0] + 1:ends[0]])


def check(root, write=False):
    readme = (root / "README.md").read_text().split("\n")
    counts = {"quoted": 0, "file": 0, "fragment": 0}
    replacements = []
    for marker, lang, begin, end in blocks(readme):
        if lang not in ("cpp", "c++", "cmake", "python"):
            continue
        text = readme[marker].strip() if marker is not None else ""
        snippet = re.match(r"<!-- snippet: (\S+) (\S+) -->$", text)
        build = re.match(r"<!-- build: (fragment (\w+)|[\w.-]+/[\w.-]+) -->$", text)
        if lang == "python" and not snippet:
            continue  # shown, not run (the torch 1.13 import shim)
        if snippet:
            code = quoted_code(root, *snippet.groups())
            if write:
                replacements.append((begin, end, code))
            elif dedent(readme[begin:end]) != code:
                quoted = dedent(readme[begin:end])
                for k, (a, b) in enumerate(zip(quoted, code)):
                    if a != b:
                        sys.exit(f"README.md:{begin + 1 + k} differs from {snippet.group(1)}:\n"
                                 f"  README: {a}\n  code:   {b}")
                sys.exit(f"README.md:{begin}: the block and {snippet.group(1)} differ in length "
                         f"({len(quoted)} vs {len(code)} lines)")
            counts["quoted"] += 1
        elif build and build.group(2) and build.group(2) not in CONTEXTS:
            sys.exit(f"README.md:{marker + 1}: unknown context {build.group(2)} "
                     f"(known: {', '.join(CONTEXTS)})")
        elif build:
            counts["fragment" if build.group(2) else "file"] += 1
        else:
            sys.exit(f"README.md:{begin}: a {lang} block without a build or snippet marker "
                     "(every code block of the README is built in CI; see tests/readme/readme_build.py)")
    if counts["file"] == 0:
        sys.exit("README.md has no whole program to build: the check would check nothing")
    for begin, end, code in reversed(replacements):
        readme[begin:end] = code
    if write:
        (root / "README.md").write_text("\n".join(readme))
    print(f"README.md: {counts['file']} whole file(s), {counts['fragment']} fragment(s), "
          f"{counts['quoted']} quoted block(s), each marked and current")


def extract(root, out, components):
    readme = (root / "README.md").read_text().split("\n")
    out.mkdir(parents=True, exist_ok=True)
    fragments = []
    for marker, lang, begin, end in blocks(readme):
        text = readme[marker].strip() if marker is not None else ""
        build = re.match(r"<!-- build: (fragment (\w+)|[\w.-]+/[\w.-]+) -->$", text)
        if not build:
            continue
        code = dedent(readme[begin:end])
        if not build.group(2):
            path = out / build.group(1)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join(code) + "\n")
            continue
        component, params, headers = CONTEXTS[build.group(2)]
        if component and component not in components:
            print(f"README.md:{begin}: fragment left out: component {component} was not built")
            continue
        includes = [l for l in code if l.startswith("#include")]
        body = [l for l in code if not l.startswith("#include")]
        n = len(fragments)
        source = [f"// README.md line {begin + 1} (context {build.group(2)}), as pasted."]
        source += includes + [f"#include {h}" for h in headers]
        source += ["", f"void ReadmeFragment{n}({params}) {{"] + ["  " + l for l in body] + ["}"]
        (out / "fragments").mkdir(exist_ok=True)
        (out / "fragments" / f"fragment{n}.cc").write_text("\n".join(source) + "\n")
        fragments.append((n, component))
    if fragments:
        needed = sorted({c for _, c in fragments if c})
        cmake = ["cmake_minimum_required(VERSION 3.18)", "project(readme_fragments CXX)",
                 "set(CMAKE_CXX_STANDARD 20)",
                 f"find_package(dcp REQUIRED {'COMPONENTS ' + ' '.join(needed) if needed else ''})"]
        for n, component in fragments:
            cmake += [f"add_library(fragment{n} OBJECT fragment{n}.cc)",
                      f"target_link_libraries(fragment{n} PRIVATE {COMPONENT_TARGETS[component]})"]
        (out / "fragments" / "CMakeLists.txt").write_text("\n".join(cmake) + "\n")
    print(f"{len(fragments)} fragment(s) written to {out / 'fragments'}")


if __name__ == "__main__":
    mode, root = sys.argv[1], Path(sys.argv[2])
    if mode == "check":
        check(root)
    elif mode == "write":
        check(root, write=True)
    elif mode == "extract":
        extract(root, Path(sys.argv[3]), sys.argv[4].split(";") if len(sys.argv) > 4 else [])
    else:
        sys.exit(__doc__)
