"""`python -m edgeinfer.node` runs the node server (same arguments as `edgeinfer serve`)."""

import sys

from edgeinfer.node.cli import main

sys.exit(main())
