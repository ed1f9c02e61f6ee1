import sys

from runtime_cupy.cli import main

sys.exit(main())
