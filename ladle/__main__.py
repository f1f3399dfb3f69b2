import os
import sys

from ladle import cli
from ladle.cli import run

code = cli.main()
if run.launched:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
raise SystemExit(code)
