import sys

try:
    from kvstore.tools.cli.main import main
except KeyboardInterrupt:  # Ctrl-C while torch is still importing: nothing was opened
    print("\ninterrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
