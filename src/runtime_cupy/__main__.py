import sys

from runtime_cupy.cli.main import main

sys.exit(main())
