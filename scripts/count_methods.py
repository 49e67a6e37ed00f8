#!/usr/bin/env python3
"""Counts the public and private member functions declared in a class body (heuristic: a
declaration statement at the class's top level whose text has '(' before any '=' or '{').
The renovation's figures (issue #28) came from it:
  scripts/count_methods.py core/engine/engine.h:Engine serving/scheduler.h:Scheduler"""
import re, sys
def count(path, cls):
    t = open(path).read()
    t = re.sub(r'//[^\n]*', '', t)
    m = re.search(r'\bclass\s+' + cls + r'\b[^;{]*\{', t)
    if not m: return None
    i = m.end(); depth = 1; access = 'private'; stmt = ''; pub = priv = 0
    while depth > 0:
        c = t[i]; i += 1
        if c == '{':
            if depth == 1:
                s = stmt.strip()
                if '(' in s.split('=')[0] and not s.startswith(('struct', 'class', 'enum', 'union')):
                    if access == 'public': pub += 1
                    else: priv += 1
                stmt = '\x00'
            depth += 1
        elif c == '}':
            depth -= 1
            if depth == 1: stmt = ''
        elif depth == 1:
            if c == ';':
                s = stmt.strip()
                if s != '\x00' and '(' in s.split('=')[0] and not s.startswith(('using', 'friend', 'struct', 'class', 'enum', 'static_assert', 'typedef')) and not re.match(r'^[\w:<>,\s\*&]+\s+\w+\s*\{', s):
                    if access == 'public': pub += 1
                    else: priv += 1
                stmt = ''
            elif c == ':' and re.fullmatch(r'\s*(public|private|protected)\s*', stmt):
                access = stmt.strip(); stmt = ''
            else:
                stmt = '' if stmt == '\x00' else stmt
                stmt += c
    return pub, priv
for spec in sys.argv[1:]:
    path, cls = spec.split(':')
    print(cls, path, count(path, cls))
