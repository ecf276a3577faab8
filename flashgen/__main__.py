"""`python -m flashgen`: the command line (flashgen.cli)."""
import sys

from flashgen.cli import main

sys.exit(main())
