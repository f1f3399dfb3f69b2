import os
import sys

from ladle import cli
from ladle.cli import run

# guarded: a child process started by spawn (vLLM's engine process) imports this module again
if __name__ == "__main__":
    code = cli.main()
    if run.launched:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
    raise SystemExit(code)
