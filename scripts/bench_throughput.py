#!/usr/bin/env python3
"""Offline throughput and engine overhead (issue 6); the same as `ringserve bench throughput`."""

import sys

from ringserve.bench.throughput import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
