import sys

from preheat.cli import main

sys.exit(main())
