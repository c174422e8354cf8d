#!/usr/bin/env python3
"""Frontend cost per output token (issue 7); the same as `ringserve bench frontend`."""

import sys

from ringserve.bench.frontend import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
