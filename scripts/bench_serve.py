#!/usr/bin/env python3
"""Load-test an OpenAI-compatible server (issue 8); the same as `ringserve bench serve`."""

import sys

from ringserve.bench.serve import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
