import sys

from runtime_sim.cli import main

sys.exit(main())
