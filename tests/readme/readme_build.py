"""README.md's quoted code equals the code it quotes.

A block preceded by `<!-- snippet: FILE NAME -->` must equal, line for line (the common
indentation removed), the lines of FILE between the comments `[NAME]` and `[NAME-end]`, which the
build compiles and a test runs. Usage: readme_snippet_check.py REPO_ROOT [--write]
(--write copies the code into README.md instead of checking).
"""
import re
import sys
from pathlib import Path


def dedent(lines):
    width = min((len(l) - len(l.lstrip()) for l in lines if l.strip()), default=0)
    return [l[width:].rstrip() for l in lines]


def main(root, write=False):
    readme = (root / "README.md").read_text().split("\n")
    checked = 0
    replacements = []
    for i, line in enumerate(readme):
        m = re.match(r"<!-- snippet: (\S+) (\S+) -->", line)
        if not m:
            continue
        path, name = m.groups()
        if not readme[i + 1].startswith("```"):
            sys.exit(f"README.md:{i + 2}: a code block must follow the snippet marker")
        end = next(j for j in range(i + 2, len(readme)) if readme[j].startswith("```"))
        quoted = dedent(readme[i + 2:end])
        source = (root / path).read_text().split("\n")
        starts = [k for k, l in enumerate(source) if f"[{name}]" in l]
        ends = [k for k, l in enumerate(source) if f"[{name}-end]" in l]
        if len(starts) != 1 or len(ends) != 1:
            sys.exit(f"{path}: needs exactly one [{name}] and one [{name}-end] comment")
        code = dedent(source[starts[0] + 1:ends[0]])
        if write:
            replacements.append((i + 2, end, code))
            checked += 1
            continue
        if quoted != code:
            for k, (a, b) in enumerate(zip(quoted, code)):
                if a != b:
                    sys.exit(f"README.md:{i + 3 + k} differs from {path}:\n  README: {a}\n  code:   {b}")
            sys.exit(f"README.md's block {name} and {path} differ in length "
                     f"({len(quoted)} vs {len(code)} lines)")
        checked += 1
    if checked == 0:
        sys.exit("README.md quotes no snippet: the check would check nothing")
    for begin, end, code in reversed(replacements):
        readme[begin:end] = code
    if write:
        (root / "README.md").write_text("\n".join(readme))
    print(f"{checked} README snippet(s) equal the compiled code")


if __name__ == "__main__":
    main(Path(sys.argv[1]), write="--write" in sys.argv[2:])
