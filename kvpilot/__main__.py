import sys

from kvpilot.cli import main

sys.exit(main())
