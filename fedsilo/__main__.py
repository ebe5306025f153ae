"""`python -m fedsilo`: the same as the `fedsilo` command."""
import sys

from fedsilo.cli import main

sys.exit(main())
