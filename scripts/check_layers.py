#!/usr/bin/env python3
"""Checks that every #include between the project's folders runs in an allowed direction
(Chromium's checkdeps idea): link rules alone miss header-only includes, this reads the text.

  scripts/check_layers.py              # checks the repository; exit 1 and one line per violation
  scripts/check_layers.py --self-test  # plants an upward include in a scratch tree: it must fail

ALLOWED is the table of directions: a folder may include its own files and those of the folders
listed for it, nothing else of the project's. Includes that name no project folder (system and
library headers) are not checked. The renovation (issue #28) changes the table with the moves.
"""
import argparse
import os
import re
import sys
import tempfile

# folder -> project folders it may include (besides itself)
ALLOWED = {
    "core": [],
    "planner": ["core"],
    "transport": ["core"],
    "cpu": ["core"],
    "gpu": ["core", "transport"],
    "cluster": ["core", "transport"],
    "bin": ["core", "cpu", "gpu", "transport", "planner", "cluster"],
    "bench": ["core", "cpu", "gpu", "transport", "planner", "cluster", "bin"],
    "tests": ["core", "cpu", "gpu", "transport", "planner", "cluster", "bin", "bench"],
}
SOURCES = (".h", ".hpp", ".cc", ".cpp", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"/]+)/[^"]*"', re.MULTILINE)


def violations(root):
    out = []
    for folder, deps in ALLOWED.items():
        ok = set(deps) | {folder}
        base = os.path.join(root, folder)
        for dirpath, dirnames, files in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(files):
                if not name.endswith(SOURCES):
                    continue
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
                for m in INCLUDE.finditer(text):
                    target = m.group(1)
                    if target in ALLOWED and target not in ok:
                        line = text.count("\n", 0, m.start()) + 1
                        out.append(f"{os.path.relpath(path, root)}:{line}: {folder}/ may not include "
                                   f"{target}/ (allowed: {', '.join(sorted(ok))})")
    return out


def self_test():
    with tempfile.TemporaryDirectory() as root:
        def write(rel, text):
            os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
            with open(os.path.join(root, rel), "w") as f:
                f.write(text)
        write("core/a.h", '#include "core/b.h"\n#include <vector>\n')
        write("bin/main.cc", '#include "core/a.h"\n#include "cluster/x.h"\n')
        if violations(root):
            print("self-test: a clean tree was reported")
            return 1
        write("core/b.h", '// an upward include, on purpose\n#include "bin/main.h"\n')
        found = violations(root)
        if len(found) != 1 or not found[0].startswith("core/b.h:2: core/ may not include bin/"):
            print("self-test: the planted upward include was not reported exactly:", found)
            return 1
    print("self-test: the planted upward include core/b.h -> bin/ was reported")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        return self_test()
    found = violations(args.root)
    for v in found:
        print(v)
    if found:
        print(f"{len(found)} include(s) against the allowed directions (scripts/check_layers.py ALLOWED)")
        return 1
    print("layers: every include runs in an allowed direction")
    return 0


if __name__ == "__main__":
    sys.exit(main())
