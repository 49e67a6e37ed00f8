#!/usr/bin/env python3
"""Checks that every #include between the project's folders runs in an allowed direction
(Chromium's checkdeps idea): link rules alone miss header-only includes, this reads the text.

  scripts/check_layers.py              # checks the repository; exit 1 and one line per violation
  scripts/check_layers.py --self-test  # plants an upward include in a scratch tree: it must fail

ALLOWED is the table of directions: a folder may include its own files and those of the folders
listed for it, nothing else of the project's. Includes that name no project folder (system and
library headers) are not checked. core/ is itself layered (core/base at the bottom, core/engine
at the top); the README of each folder says what it holds.
"""
import argparse
import os
import re
import sys
import tempfile

# folder -> project folders it may include (besides itself). A folder may be nested
# ("core/base"); a file belongs to the longest folder its path starts with, and so does an
# include's target. Lower layers first: each may include only layers listed before it.
CORE = ["core/base", "core/model", "core/tokenizer", "core/ports", "core/sparse", "core/engine"]
ALLOWED = {
    "core": [],  # nothing lives in core/ itself; its layers are the folders below
    "core/base": [],
    "core/model": ["core/base"],
    "core/tokenizer": ["core/base", "core/model"],
    "core/ports": ["core/base", "core/model"],
    "core/sparse": ["core/base", "core/model", "core/ports"],
    "core/engine": ["core/base", "core/model", "core/ports", "core/sparse"],
    "core/tls": ["core/base"],  # OpenSSL contexts; not in CORE: only cluster, serving/openai and serving/router use it
    "planner": ["core/base", "core/model", "core/ports"],
    "transport": ["core/base", "core/ports"],
    "cpu": CORE,
    "gpu": CORE + ["transport"],
    "cluster": CORE + ["core/tls", "transport"],
    "serving/structured": ["core/base", "core/model", "core/tokenizer"],
    "serving": CORE + ["serving/structured"],
    "serving/openai": CORE + ["core/tls", "serving", "serving/structured"],
    # the router in front of serve replicas: the server's HTTP request handling and API errors
    "serving/router": ["core/base", "core/tls", "serving/openai"],
    "research": CORE,
    "runtime": CORE + ["cpu", "gpu", "transport", "planner", "cluster", "serving", "serving/structured"],
    "bin": CORE + ["cpu", "gpu", "transport", "planner", "cluster", "serving", "serving/structured",
                   "serving/openai", "serving/router", "research", "runtime"],
}
ALLOWED["bench"] = ALLOWED["bin"] + ["bin"]
ALLOWED["tests"] = ALLOWED["bench"] + ["bench"]
SOURCES = (".h", ".hpp", ".cc", ".cpp", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def folder_of(path):
    """The longest ALLOWED folder that `path` (relative, '/'-separated) lies in, or None."""
    best = None
    for folder in ALLOWED:
        if (path == folder or path.startswith(folder + "/")) and (best is None or len(folder) > len(best)):
            best = folder
    return best


def violations(root):
    out = []
    for top in sorted({f.split("/")[0] for f in ALLOWED}):
        for dirpath, dirnames, files in os.walk(os.path.join(root, top)):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(files):
                if not name.endswith(SOURCES):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                folder = folder_of(rel)
                ok = set(ALLOWED[folder]) | {folder}
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
                for m in INCLUDE.finditer(text):
                    target = folder_of(m.group(1))
                    if target is not None and target not in ok:
                        line = text.count("\n", 0, m.start()) + 1
                        out.append(f"{rel}:{line}: {folder}/ may not include {target}/ "
                                   f"(allowed: {', '.join(sorted(ok))})")
    return out


def self_test():
    with tempfile.TemporaryDirectory() as root:
        def write(rel, text):
            os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
            with open(os.path.join(root, rel), "w") as f:
                f.write(text)
        write("core/base/a.h", '#include "core/base/b.h"\n#include <vector>\n')
        write("core/model/m.h", '#include "core/base/a.h"\n')
        write("bin/main.cc", '#include "core/base/a.h"\n#include "cluster/x.h"\n')
        if violations(root):
            print("self-test: a clean tree was reported")
            return 1
        write("core/base/b.h", '// an upward include, on purpose\n#include "bin/main.h"\n')
        found = violations(root)
        if len(found) != 1 or not found[0].startswith("core/base/b.h:2: core/base/ may not include bin/"):
            print("self-test: the planted upward include was not reported exactly:", found)
            return 1
        write("core/base/b.h", '// upward between the layers of core, on purpose\n#include "core/model/m.h"\n')
        found = violations(root)
        if len(found) != 1 or not found[0].startswith("core/base/b.h:2: core/base/ may not include core/model/"):
            print("self-test: the planted include core/base -> core/model was not reported exactly:", found)
            return 1
    print("self-test: the planted upward includes core/base/b.h -> bin/ and -> core/model/ were reported")
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
