import sys

from runplan.cli import main

sys.exit(main())
