import sys

try:
    from runtime_cupy.cli.main import main

    status = main()
except KeyboardInterrupt:  # Ctrl-C while the modules load (or past the command's own care)
    sys.stderr.write("cancelled\n")
    status = 130
sys.exit(status)
