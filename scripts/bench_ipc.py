#!/usr/bin/env python3
"""IPC ring benchmark (issue 3); the same as ``ringserve bench ipc``. See docs/benchmarks.md."""

import sys

from ringserve.bench.ipc import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
