"""``python -m torchfuse``: report the environment, check every op family once against its plain
PyTorch reference on the available device, then print one benchmark row per family. Exit status 1 if
a check fails. ``python -m torchfuse --help`` lists the options (--quick, --json, --plot, ...)."""
import sys

from torchfuse.selfcheck import main

if __name__ == "__main__":
    sys.exit(main())
