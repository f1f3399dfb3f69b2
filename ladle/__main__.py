import os
import sys

from ladle import cli

code = cli.main()
if cli.launched:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
raise SystemExit(code)
