"""The pooling routes' tests import the app harness of tests/http (`http_app_harness`)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
