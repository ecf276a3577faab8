#!/usr/bin/env python3
"""The `flashgen` command run from a checkout: `python cli.py tune ...` is `flashgen tune ...` (flashgen.cli)."""
import sys

from flashgen.cli import main

if __name__ == "__main__":
    sys.exit(main())
