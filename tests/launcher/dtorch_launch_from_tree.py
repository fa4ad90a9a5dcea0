"""``dtorch-launch`` for the tests: the CLI of this source tree, whether or not it is installed."""
import sys

from launch_tree import load_launcher_from_tree

if __name__ == "__main__":
    load_launcher_from_tree()
    from dtorch_launcher.cli import main

    sys.exit(main())
