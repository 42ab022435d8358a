"""Kept for old command lines: ``benchmarks/bench_vlm.py`` (``--model qwen2`` by default)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_vlm import main  # noqa: E402

if __name__ == "__main__":
    main()
